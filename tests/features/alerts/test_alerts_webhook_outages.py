"""A generic webhook through failures, against a receiver of the test's own that drops a batch it
already has by the anomalies' keys: HTTP 500s, answers withheld past the sender's timeout (the
receiver kept the batch, so the retry is a duplicate it drops), and a 10 s outage of the receiver in
the middle of a run; afterwards every anomaly is in the receiver exactly once by key, in the order
found. `mindmon alerts resend` delivers a spool the run left to the webhook, once."""
import os
import subprocess
import sys
import time

import pytest
import yaml

from mindmon.core.engine import RunInfo
from mindmon.features.alerts import AlertConfig, AlertSink
from tests.support.servers import free_port
from tests.features.alerts.test_alerts_webhook import TOKEN, alert_section, key_of, records
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.serial   # receivers down and back while deliveries are retried in real time

OUTAGE_SECONDS = 10.0
STEP_SECONDS = 0.05


def run_id(output_dir):
    with open(os.path.join(output_dir, "anomaly_detected", "rank0", "run_id")) as f:
        return f.read().strip()


def received_keys(receiver, path):
    """Every item key the receiver was sent, in arrival order, duplicates included."""
    return [item["key"] for body in receiver.bodies(path) for item in body["items"]]


def first_of_each(keys):
    return list(dict.fromkeys(keys))


def expected_keys(output_dir, steps, names=3):
    rid = run_id(output_dir)
    return [key_of(rid, 0, step, None, f"device_norm/p{n}", "norm") for step in range(1, steps + 1)
            for n in range(names)]


def test_500s_timeouts_and_a_ten_second_outage_lose_nothing_and_deliver_each_anomaly_once_by_key(tmp_path):
    receiver = Receiver()
    inform = {"recipient": "webhook", "url": f"{receiver.base}/hook/{TOKEN}", "timeout": 1, "retry_interval": 0.2,
              "retry_max_interval": 1.0, "close_timeout": 30, "queue_size": 30, "batch_size": 20}
    sink = AlertSink(AlertConfig.parse("monitor.alert", alert_section(inform)), str(tmp_path))
    sink.open(RunInfo(rank=0))
    receiver.fail_next(3, 500)
    seconds, step, started = [], 0, time.monotonic()
    down, down_since, up = None, None, None   # the steps the outage spans
    while time.monotonic() - started < OUTAGE_SECONDS + 4:
        step += 1
        if step == 15:
            receiver.stall_next(2, 1.6)    # kept, then answered after the sender's 1 s timeout
        if step == 30:
            receiver.stop()
            down, down_since = step, time.monotonic()
        if up is None and down_since is not None and time.monotonic() - down_since >= OUTAGE_SECONDS:
            receiver.start()
            up = step
        begun = time.perf_counter()
        sink.write(records(step, 3))
        sink.flush()
        seconds.append(time.perf_counter() - begun)
        time.sleep(STEP_SECONDS)
    sink.close()
    receiver.stop()
    report = sink.reports[0]
    print(f"\n{step} steps, receiver down over steps {down}-{up}; {report.summary()}")
    print(f"sink write + flush per step: median {sorted(seconds)[len(seconds) // 2] * 1e3:.2f} ms, "
          f"max {max(seconds) * 1e3:.2f} ms")

    want = expected_keys(tmp_path, step)
    sent = received_keys(receiver, "/hook")
    assert first_of_each(sent) == want                 # every anomaly, in the order found
    assert len(sent) > len(want)                        # the withheld answers made duplicates, dropped by key
    assert report.delivered == len(want) and report.complete and report.spooled == 0
    assert report.failed_attempts >= 3 + 2 + 5          # the 500s, the timeouts, the attempts in the outage
    assert not os.path.exists(tmp_path / "anomaly_detected" / "rank0" / "spool") or \
        not [n for n in os.listdir(tmp_path / "anomaly_detected" / "rank0" / "spool") if n.endswith(".jsonl")]
    assert all(r["headers"]["Idempotency-Key"] for r in receiver.of("/hook"))


def resend(run_dir, *extra):
    return subprocess.run([sys.executable, "-m", "mindmon", "alerts", "resend", str(run_dir), *extra],
                          capture_output=True, text=True, timeout=120)


def test_resend_delivers_a_spool_to_the_webhook_once(tmp_path):
    port = free_port()   # nothing listens during the run
    inform = {"recipient": "webhook", "url": f"http://127.0.0.1:{port}/hook/{TOKEN}", "timeout": 1,
              "retry_interval": 0.2, "retry_max_interval": 0.5, "close_timeout": 1}
    section = alert_section(inform)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"monitor": {"alert": section}}))
    run_dir = tmp_path / "run"
    sink = AlertSink(AlertConfig.parse("monitor.alert", section), str(run_dir))
    sink.open(RunInfo(rank=0))
    for step in (1, 2, 3):
        sink.write(records(step, 3))
        sink.flush()
    sink.run_crashed(RuntimeError("out of memory"))
    sink.close()
    assert sink.reports[0].undelivered == {"connection refused": 10} and sink.reports[0].spooled == 10

    receiver = Receiver(port)
    try:
        without = resend(run_dir)
        assert without.returncode == 1 and "give the run's configuration with --config" in without.stderr
        assert TOKEN not in without.stderr + without.stdout
        done = resend(run_dir, "--config", str(config))
        again = resend(run_dir, "--config", str(config))
    finally:
        receiver.stop()
    assert done.returncode == 0, done.stderr
    assert "10 anomalies delivered to webhook" in done.stdout and TOKEN not in done.stdout + done.stderr
    assert again.returncode == 0 and "nothing to resend" in again.stdout
    sent = received_keys(receiver, "/hook")
    assert sent[:9] == expected_keys(run_dir, 3) and len(sent) == 10 == len(set(sent))
    (event,) = [item for body in receiver.bodies("/hook") for item in body["items"] if item["type"] == "event"]
    assert (event["kind"], event["step"], event["details"]["exception"]) == ("crashed", 3,
                                                                             "RuntimeError: out of memory")
