"""monitor.trackers.prometheus with a real Prometheus server (Debian's `prometheus`, installed by
tools/test_services.sh) scraping rank 0's endpoint; PromQL through its HTTP API returns the run's values,
checked against the JSONL records and the anomaly dump the same run wrote, and the loss against numpy."""
import json
import logging
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from tests.support.jsonl import read_jsonl
from tests.support.servers import free_port
from tests.features.trackers.test_trackers import failure_lines, numpy_losses, recorded, train, wait_until

STEPS = 4


class PrometheusServer:
    """A throwaway Prometheus on a free localhost port, scraping one target every second."""

    def __init__(self, folder, target_port):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("Prometheus is needed: apt-get install -y prometheus (make test does it under root)")
        self.port = free_port()
        config = folder / "prometheus.yml"
        config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                          "scrape_configs:\n"
                          "  - job_name: mindmon\n"
                          f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n")
        self.log = open(folder / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, promql):
        """The instant vector's samples as [(labels, value)]."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                body = json.load(answer)
        except OSError:
            return []
        assert body["status"] == "success", body
        return [(sample["metric"], float(sample["value"][1])) for sample in body["data"]["result"]]

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def _one(server, promql):
    [(labels, value)] = server.query(promql)
    return labels, value


def test_prometheus_scrapes_the_run(tmp_path):
    output = tmp_path / "out"
    started = time.time()
    group = train(output, {"prometheus": {"port": 0, "addr": "127.0.0.1"}}, steps=STEPS, alert=True)
    sink = next(s for s in group.sinks if type(s).__name__ == "PrometheusSink")
    server = PrometheusServer(tmp_path, sink.port)
    try:
        wait_until(lambda: [v for _, v in server.query("mindmon_step")] == [STEPS], 60,
                   "Prometheus to scrape the last step")
        jsonl = [r for r in read_jsonl(output / "rank_0" / "metrics.jsonl") if r["step"] == STEPS]
        last = recorded(output)[STEPS]
        labels, loss = _one(server, 'mindmon_value{tag="lm_loss"}')
        assert loss == pytest.approx(last["lm_loss"], rel=1e-6)
        assert loss == pytest.approx(numpy_losses(STEPS)[-1], rel=1e-5)
        assert (labels["rank"], labels["host"], labels["device"], labels["id"]) == ("0", socket.gethostname(), "0", "0")
        assert _one(server, 'mindmon_value{tag="grad-norm"}')[1] == pytest.approx(last["grad-norm"], rel=1e-6)
        step_time = next(r["value"] for r in jsonl if r["kind"] == "step_time" and r["name"] == "step")
        assert _one(server, 'mindmon_step_time_seconds{phase="step"}')[1] == pytest.approx(step_time, rel=1e-9)
        rate = next(r["value"] for r in jsonl if r["kind"] == "throughput" and r["name"] == "samples_per_second")
        assert _one(server, 'mindmon_throughput{name="samples_per_second"}')[1] == pytest.approx(rate, rel=1e-9)
        assert rate == pytest.approx(8 / step_time, rel=1e-6)   # 8 samples a step
        stamp = _one(server, "mindmon_last_step_timestamp_seconds")[1]
        assert started < stamp < time.time()
        # anomaly counts by rule: the dump's entries, counted here from the file
        with open(output / "anomaly_detected" / "rank0" / "anomaly.json") as f:
            dumped = [entry["rule_name"] for entry in json.load(f).values()]
        assert dumped and set(dumped) == {"AnomalyNan"}
        wait_until(lambda: [v for _, v in server.query('mindmon_anomalies{rule="AnomalyNan"}')] == [len(dumped)], 30,
                   f"the anomaly count {len(dumped)}")
        # a PromQL join on the labels a dashboard shares with NPU Exporter's series
        joined = server.query('mindmon_value{tag="lm_loss"} * on(host, device) group_left mindmon_step')
        assert [value for _, value in joined] == [pytest.approx(loss * STEPS, rel=1e-6)]
    finally:
        group.close()
        server.stop()
    with pytest.raises(OSError):   # the endpoint stops with the run
        urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=2)


def test_a_port_in_use_switches_the_endpoint_off_with_one_line(tmp_path, caplog):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    output = tmp_path / "out"
    try:
        with caplog.at_level(logging.ERROR, logger="mindmon"):
            train(output, {"prometheus": {"port": taken.getsockname()[1], "addr": "127.0.0.1"}}, steps=3).close()
    finally:
        taken.close()
    assert sorted(recorded(output)) == [1, 2, 3]
    lines = failure_lines(caplog, "PrometheusSink")
    assert len(lines) == 1 and "monitor.trackers.prometheus" in lines[0], lines
