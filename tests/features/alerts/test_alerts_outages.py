"""Alert delivery when the outside world fails, against real servers and real faults: PostgreSQL,
MariaDB, SQLite and aiosmtpd made unavailable for ~10 s in the middle of a real MindSpore training
loop and brought back (nothing lost, nothing twice, in order); a port that accepts and never
answers (training runs on, delivery gives up by its timeout, the anomalies stay in the spool);
`mindmon alerts resend` delivering a spool later; a retried batch arriving once; full buffers
counted. Each step's time is printed, never asserted."""
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import yaml

from tests.support.jsonl import read_jsonl
from mindmon.features.alerts import AlertConfig, AlertSink
from mindmon.features.alerts.anomaly import KeyedAnomaly, anomaly_from_json
from mindmon.features.alerts.buffer import read_spool
from mindmon.features.alerts.recipients import build_recipient
from tests.support.servers import MYSQL_PASSWORD, PG_PASSWORD, free_port
from tests.features.alerts.test_alerts import email_inform, plain_loop
from tests.loop.test_plain_loop import _data as regression_data

pytestmark = pytest.mark.serial   # servers stopped and started while deliveries are retried in real time

EVERY_VALUE = {"rule_name": "AnomalyNan", "args": {"threshold": 0.0}}   # fires on every finite value but 0
STATISTIC = {"local_loss": "loss", "device_loss": "loss", "device_norm": "norm"}
OUTAGE_SECONDS = 10.0
STEP_PAUSE = 0.01   # stands in for the model's compute, so that a 10 s outage spans a few hundred steps
QUICK_RETRY = {"timeout": 2, "retry_interval": 0.2, "retry_max_interval": 1.0}


def url_text(url) -> str:
    return url.render_as_string(hide_password=False)


def train(tmp_path, config, keep_going, on_step=lambda step: None):
    """The README's plain loop (K = 2, SGD) with the alert sink among the group's sinks; runs while
    `keep_going(step)`; returns (alert sink, steps run, each step's seconds)."""
    import numpy as np
    from mindspore import Tensor

    from mindmon import split_batch

    alerts = AlertSink(config, str(tmp_path))
    group, train_step = plain_loop(tmp_path, alerts, lr=0.01)
    x, y = regression_data(np.random.default_rng(0))
    step, seconds = 0, []
    while keep_going(step):
        step += 1
        on_step(step)
        started = time.perf_counter()
        train_step(split_batch((Tensor(x), Tensor(y)), 2))
        group.flush(step)
        seconds.append(time.perf_counter() - started)
        time.sleep(STEP_PAUSE)
    group.close()
    return alerts, step, seconds


def expected_anomalies(tmp_path):
    """(step, micro-step, tag, statistic) of every value the JSONL sink wrote that is finite and not 0
    (what the rule fires on), in the order written."""
    rows = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    return [(r["step"], r["micro_step"], f"{r['kind']}/{r['name']}", STATISTIC[r["kind"]]) for r in rows
            if r["kind"] in STATISTIC and isinstance(r["value"], float) and r["value"] != 0.0]


def print_step_times(label, seconds, during=None):
    def describe(values):
        return f"median {statistics.median(values) * 1e3:.2f} ms, max {max(values) * 1e3:.2f} ms over {len(values)}"

    print(f"\n[{label}] step time (train step + mindmon's step end; machine shared): {describe(seconds)}")
    if during:
        inside = [s for i, s in enumerate(seconds, start=1) if during[0] <= i <= during[1]]
        outside = [s for i, s in enumerate(seconds, start=1) if not during[0] <= i <= during[1]]
        print(f"[{label}]   steps {during[0]}-{during[1]} (recipients unavailable): {describe(inside)}")
        print(f"[{label}]   the other steps: {describe(outside)}")


def select_rows(url, table):
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(text(f"SELECT step, micro_step, tag_name, statistic, anomaly_key FROM {table} "
                                       f"ORDER BY id")).all()
    engine.dispose()
    return [tuple(row) for row in rows]


class SqliteLock:
    """Another process holding an exclusive lock on the SQLite file: writers get `database is locked`."""

    def __init__(self, path: str):
        code = ("import sqlite3, sys, time\n"
                "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                "c.execute('BEGIN EXCLUSIVE')\nprint('locked', flush=True)\nsys.stdin.readline()\n")
        self.process = subprocess.Popen([sys.executable, "-c", code, path], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "locked"

    def release(self):
        self.process.communicate("\n", timeout=30)


class Outage(threading.Thread):
    """Makes the servers (and the SQLite file, when given) unavailable for `seconds`, then brings them back."""

    def __init__(self, servers, sqlite_path=None, seconds=OUTAGE_SECONDS):
        super().__init__(daemon=True)
        self.servers, self.sqlite_path, self.seconds = servers, sqlite_path, seconds
        self.down, self.restored = threading.Event(), threading.Event()
        self.steps = [None, None]

    def run(self):
        lock = SqliteLock(self.sqlite_path) if self.sqlite_path else None
        for server in self.servers:
            server.stop()
        self.down.set()
        time.sleep(self.seconds)
        for server in self.servers:
            server.start()
        if lock is not None:
            lock.release()
        self.restored.set()

    def on_step(self, step, at=30):
        """The training loop's hook: starts the outage at step `at`, notes the steps it spans."""
        if step == at:
            self.start()
            assert self.down.wait(60)
            self.steps[0] = step
        if self.restored.is_set() and self.steps[1] is None:
            self.steps[1] = step - 1

    def keep_going(self, step, after=30):
        """Train until `after` steps past the recovery."""
        return self.steps[1] is None or step <= self.steps[1] + after


def email_counts(messages):
    """(anomalies per e-mail from the subjects, the counts by tag summed over every digest's body)."""
    per_message, by_tag = [], Counter()
    for message in messages:
        per_message.append(int(re.match(r"mindmon: (\d+) anomal", message["Subject"]).group(1)))
        body = message.get_payload(decode=True).decode()
        for line in body.splitlines():
            counted = re.fullmatch(r"\s+(\d+)\s+AnomalyNan\s+(\S+) (\S+)", line)
            if counted:
                by_tag[counted.group(2), counted.group(3)] += int(counted.group(1))
    return per_message, by_tag


def test_a_ten_second_outage_of_every_recipient_loses_nothing_and_delivers_nothing_twice(
        tmp_path, postgres_server, mariadb_server, smtp_inbox, caplog):
    sqlite_path = str(tmp_path / "alerts.db")
    options = {**QUICK_RETRY, "queue_size": 200, "close_timeout": 60}
    config = AlertConfig.parse("monitor.alert", {"rules": [EVERY_VALUE], "dump": True, "inform": [
        {"connection_str": url_text(postgres_server.url), "table": "outage_rows", **options},
        {"connection_str": url_text(mariadb_server.url), "table": "outage_rows", **options},
        {"connection_str": f"sqlite:///{sqlite_path}", "table": "outage_rows", **options, "timeout": 0.5},
        email_inform(smtp_inbox.host, smtp_inbox.port, email_interval=1, **options)]})
    outage = Outage((postgres_server, mariadb_server, smtp_inbox), sqlite_path)
    with caplog.at_level(logging.INFO, logger="mindmon"):
        alerts, steps, seconds = train(tmp_path, config, outage.keep_going, outage.on_step)
    expected = expected_anomalies(tmp_path)
    print_step_times("outage", seconds, tuple(outage.steps))
    print(f"[outage] {steps} steps, {len(expected)} anomalies; "
          + "; ".join(report.summary() for report in alerts.reports))
    assert steps == outage.steps[1] + 31 and len(expected) == 5 * steps   # training went on throughout
    for url in (postgres_server.url, mariadb_server.url, f"sqlite:///{sqlite_path}"):
        rows = select_rows(url, "outage_rows")
        assert [row[:4] for row in rows] == expected, url      # every anomaly, once, in the order found
        assert len({row[4] for row in rows}) == len(rows)
    per_message, by_tag = email_counts(smtp_inbox.messages)
    assert sum(per_message) == len(expected) and len(per_message) > 1
    assert by_tag == Counter((tag, statistic) for _, _, tag, statistic in expected)
    for report in alerts.reports:
        assert report.delivered == len(expected) and report.complete and report.failed_attempts > 0, report
    assert report.folded == sum(n - 20 for n in per_message if n > 20)
    assert caplog.text.count("works again after") == 4
    assert not os.listdir(tmp_path / "anomaly_detected" / "rank0" / "spool")   # nothing left behind


def test_a_sixty_second_outage_of_postgresql_loses_nothing(tmp_path, postgres_server, caplog):
    """PostgreSQL stopped for 60 s in the middle of the run (a few thousand steps here): the memory buffer
    overflows into the spool, every anomaly arrives once, in the order found, after the restart."""
    options = {**QUICK_RETRY, "queue_size": 200, "close_timeout": 60}
    config = AlertConfig.parse("monitor.alert", {"rules": [EVERY_VALUE], "inform": [
        {"connection_str": url_text(postgres_server.url), "table": "long_outage_rows", **options}]})
    outage = Outage((postgres_server,), seconds=60.0)
    with caplog.at_level(logging.INFO, logger="mindmon"):
        alerts, steps, seconds = train(tmp_path, config, outage.keep_going, outage.on_step)
    expected = expected_anomalies(tmp_path)
    print_step_times("60 s outage", seconds, tuple(outage.steps))
    print(f"[60 s outage] {steps} steps, {len(expected)} anomalies; {alerts.reports[0].summary()}")
    assert len(expected) == 5 * steps and len(expected) > options["queue_size"] * 2   # it outgrew memory
    rows = select_rows(postgres_server.url, "long_outage_rows")
    assert [row[:4] for row in rows] == expected and len({row[4] for row in rows}) == len(rows)
    report, = alerts.reports
    assert report.delivered == len(expected) and report.complete and report.failed_attempts > 0, report
    assert caplog.text.count("works again after") == 1
    assert not os.listdir(tmp_path / "anomaly_detected" / "rank0" / "spool")


def test_a_recipient_that_never_answers_is_given_up_on_by_its_timeout(tmp_path, hanging_smtp, caplog):
    silent = f"127.0.0.1:{hanging_smtp.port}"
    options = {"timeout": 1, "close_timeout": 3, "retry_interval": 0.5, "queue_size": 50}
    config = AlertConfig.parse("monitor.alert", {"rules": [EVERY_VALUE], "inform": [
        {"connection_str": f"postgresql+psycopg2://u:{PG_PASSWORD.replace('@', '%40')}@{silent}/db", **options},
        {"connection_str": f"mysql+pymysql://u:pw9@{silent}/db", **options},
        email_inform("127.0.0.1", hanging_smtp.port, **options)]})
    with caplog.at_level(logging.INFO, logger="mindmon"):
        alerts, steps, seconds = train(tmp_path, config, lambda step: step < 100)
    expected = expected_anomalies(tmp_path)
    print_step_times("silent recipients", seconds)
    print("[silent recipients] " + "; ".join(report.summary() for report in alerts.reports))
    assert steps == 100 and len(expected) == 500 and hanging_smtp.accepted.is_set()
    for report in alerts.reports:
        assert report.delivered == 0 and report.undelivered == {"timeout": 500}, report.summary()
        assert report.spooled == 500 and report.failed_attempts >= 2
        _, items = read_spool(report.spool_path)
        assert [(i.anomaly.step, i.anomaly.micro_step, i.anomaly.tag_name, i.anomaly.statistic)
                for i in items] == expected
    assert caplog.text.count("failed (timeout)") == 3 and PG_PASSWORD not in caplog.text


def test_resend_delivers_a_spool_later_and_only_once(tmp_path, postgres_server, mariadb_server, caplog):
    urls = [url_text(postgres_server.url), url_text(mariadb_server.url)]
    alert = {"rules": [EVERY_VALUE], "dump": True, "inform": [
        {"connection_str": url, "table": "resent_rows", "timeout": 1, "close_timeout": 1} for url in urls]}
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({"monitor": {"alert": alert}}))
    postgres_server.stop()
    mariadb_server.stop()
    try:
        alerts, steps, _ = train(tmp_path / "run", AlertConfig.parse("monitor.alert", alert), lambda s: s < 20)
    finally:
        postgres_server.start()
        mariadb_server.start()
    expected = expected_anomalies(tmp_path / "run")
    assert [report.spooled for report in alerts.reports] == [len(expected)] * 2 == [100] * 2
    # the first 30 arrive before the resend (as if an earlier attempt's commit had gone through)
    _, items = read_spool(alerts.reports[1].spool_path)
    build_recipient(AlertConfig.parse("a", alert).inform[1]).deliver(items[:30])
    command = [sys.executable, "-m", "mindmon", "alerts", "resend", str(tmp_path / "run")]
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 1 and "give the run's configuration with --config" in refused.stderr
    done = subprocess.run(command + ["--config", str(config_file)], capture_output=True, text=True)
    print(done.stdout)
    assert done.returncode == 0, done.stderr
    again = subprocess.run(command + ["--config", str(config_file)], capture_output=True, text=True)
    assert "nothing to resend" in again.stdout
    for url in urls:
        assert [row[:4] for row in select_rows(url, "resent_rows")] == expected
    for secret in (PG_PASSWORD, MYSQL_PASSWORD, "s3cr%40t"):
        assert secret not in refused.stdout + refused.stderr + done.stdout + done.stderr + again.stdout


def keyed(run_id, steps):
    return [KeyedAnomaly.of(run_id, anomaly_from_json({
        "rank": 0, "step": step, "micro_step": None, "pp_stage": 0, "vpp_stage": 0, "call_id": step,
        "tag_name": "device_loss/loss", "message": f"m{step}", "group_mates": [0], "kind": "device_loss",
        "name": "loss", "statistic": "loss", "value": "nan", "rule_name": "AnomalyNan"})) for step in steps]


def test_a_batch_delivered_again_arrives_once_on_every_database(tmp_path, postgres_server, mariadb_server):
    """A batch whose commit went through but whose answer was lost is sent again by the retry:
    the key's unique constraint keeps one row, and other rows of the batch still arrive."""
    urls = [url_text(postgres_server.url), url_text(mariadb_server.url), f"sqlite:///{tmp_path / 'k.db'}"]
    for url in urls:
        recipient = build_recipient(AlertConfig.parse("a", {"rules": [EVERY_VALUE], "inform": {
            "connection_str": url, "table": "keyed_rows"}}).inform[0])
        recipient.deliver(keyed("run-a", [1, 2, 3]))
        recipient.deliver(keyed("run-a", [1, 2, 3]))
        recipient.deliver(keyed("run-a", [2, 3, 4]) + keyed("run-b", [1]))   # another run's step 1 is another anomaly
        recipient.close()
        rows = select_rows(url, "keyed_rows")
        assert [row[0] for row in rows] == [1, 2, 3, 4, 1], url
        assert len({row[4] for row in rows}) == 5


def test_full_buffers_are_counted_by_cause(tmp_path, caplog):
    dead = f"mysql+pymysql://u:pw9@127.0.0.1:{free_port()}/db"
    config = AlertConfig.parse("a", {"rules": [EVERY_VALUE], "inform": {
        "connection_str": dead, "queue_size": 30, "spool_size": 50, "timeout": 1, "close_timeout": 0.5}})
    sink = AlertSink(config, str(tmp_path))
    for step in range(1, 101):
        sink.write([record for record in _records(step)])
    with caplog.at_level(logging.INFO, logger="mindmon"):
        sink.close()
    report = sink.reports[0]
    assert report.undelivered == {"buffer full": 20, "connection refused": 80} and report.spooled == 80
    assert [i.anomaly.step for i in read_spool(report.spool_path)[1]] == list(range(1, 81))
    assert "80 left in" in caplog.text and "pw9" not in caplog.text


def _records(step):
    from mindmon.core.records import Record

    return [Record(step, None, 0, "device_loss", "loss", 1.0 + step)]


@pytest.mark.parametrize("key,value,allowed", [
    ("spool_size", -1, "an int >= 0"), ("queue_size", 0, "an int >= 1"), ("retry_interval", 0, "seconds"),
    ("batch_size", 1.5, "an int >= 1"), ("retry_max_interval", 0.1, ">= retry_interval (1)"),
])
def test_delivery_limits_are_checked(key, value, allowed):
    from mindmon.config import ConfigError

    with pytest.raises(ConfigError) as error:
        AlertConfig.parse("monitor.alert", {"rules": [EVERY_VALUE], "inform": {
            "connection_str": "sqlite://", key: value}})
    assert str(error.value).startswith(f"monitor.alert.inform.{key}: got {value!r}") and allowed in str(error.value)


FULL_DISK_JOB = '''
import logging, resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))   # files above it: EFBIG
from mindmon.features.alerts import AlertConfig, AlertSink
from mindmon.core.records import Record
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
sink = AlertSink(AlertConfig.parse("alert", {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 0.0}}],
    "dump": True, "inform": {"connection_str": sys.argv[3], "queue_size": 10, "timeout": 1, "close_timeout": 0.5}}),
    sys.argv[1])
for step, count in enumerate([20, 200, 1, 1, 1], start=1):
    sink.write([Record(step, None, 0, "grad_reduced", f"p{i}/norm", 1.0) for i in range(count)])
    sink.flush()
    print("step", step, flush=True)
sink.close()
print("after training:", sink.reports[0].summary())
'''


def test_a_full_disk_keeps_the_dump_and_the_spool_whole(tmp_path):
    """RLIMIT_FSIZE (64 KiB a file) in a subprocess: step 2's 200 anomalies fit neither in the dump
    nor in the spool; each failure is logged once, the files keep what they had, training goes on,
    later anomalies still reach the spool."""
    dead = f"mysql+pymysql://u:pw9@127.0.0.1:{free_port()}/db"
    job = subprocess.run([sys.executable, "-c", FULL_DISK_JOB, str(tmp_path), str(64 * 1024), dead],
                         capture_output=True, text=True, timeout=120)
    print(job.stdout, job.stderr[-3000:])
    assert job.returncode == 0 and "Traceback" not in job.stderr
    assert job.stdout.splitlines()[-1].startswith("after training:") and "step 5" in job.stdout
    assert job.stderr.count("anomaly.json failed ([Errno 27] File too large)") == 1
    assert job.stderr.count("spool write failed (File too large); anomalies are dropped") == 1
    folder = tmp_path / "anomaly_detected" / "rank0"
    dumped = json.loads((folder / "anomaly.json").read_text())
    assert [(e["step"], e["name"]) for e in dumped.values()] == [(1, f"p{i}/norm") for i in range(20)]
    spool = next((folder / "spool").glob("*.jsonl"))
    assert [(i.anomaly.step, i.anomaly.name) for i in read_spool(str(spool))[1]] == \
        [(1, f"p{i}/norm") for i in range(20)] + [(3, "p0/norm"), (4, "p0/norm"), (5, "p0/norm")]
    assert "undelivered (connection refused: 23, spool write failed (File too large): 200)" in job.stdout
    assert "pw9" not in job.stdout + job.stderr
