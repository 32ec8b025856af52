"""The Prometheus endpoint of rank 0: the latest step's values, served at `http://<addr>:<port>/metrics` by
prometheus_client's server on its own thread. The training thread only swaps in the step's snapshot (a dict
made from its records); the series are built from it when Prometheus scrapes.

Series (every one labelled `rank`, `host`, `device`, and `id`: the device again, under the label MindCluster
NPU Exporter gives it, so a dashboard joins the two on the device; docs/trackers.md):
    mindmon_value{tag}                      every step-level value under its TensorBoard tag
    mindmon_step                            the latest step
    mindmon_last_step_timestamp_seconds     Unix time when the latest step's records arrived
    mindmon_step_time_seconds{phase}        monitor.speed: the step's wall time and its phases
    mindmon_throughput{name}                monitor.speed: samples_per_second, tokens_per_second, job_*
    mindmon_mfu{name}                       monitor.speed: MFU (and HFU) when it records them
    mindmon_across_ranks{metric,statistic}  monitor.across_ranks: min/mean/max/min_rank/max_rank over the ranks
    mindmon_anomalies{rule, rank}           anomalies found so far by each alert rule, per rank, from the
                                            anomaly dumps of this host's ranks (read at scrape time)
"""
import glob
import json
import os
import socket
import time
from typing import Dict, Optional, Sequence, Tuple

from mindmon.core.engine import RunInfo, Sink
from mindmon.core.records import ACROSS_RANKS, STEP_TIME, THROUGHPUT, Record
from mindmon.features.trackers.config import PrometheusConfig
from mindmon.features.trackers.worker import TrackerError, step_scalars

ANOMALY_DUMPS = os.path.join("anomaly_detected", "rank*", "anomaly.json")   # the alerts feature's dumps
MFU_NAMES = ("mfu", "hfu")


def device_label(rank: int) -> str:
    """The device this process drives: DEVICE_ID as Ascend's launchers set it, else the local rank."""
    for variable in ("DEVICE_ID", "LOCAL_RANK", "RANK_ID_LOCAL"):
        if os.environ.get(variable, "").isdigit():
            return os.environ[variable]
    return str(rank)


def snapshot(records: Sequence[Record]) -> Optional[dict]:
    """The series of the latest step in `records` (None: no step-level record)."""
    by_step = step_scalars(records)
    if not by_step:
        return None
    step = max(by_step)
    latest = [r for r in records if r.step == step and r.micro_step is None]
    families: Dict[str, Dict[Tuple, float]] = {"step_time": {}, "throughput": {}, "mfu": {}, "across_ranks": {}}
    for record in latest:
        if not isinstance(record.value, (int, float)):
            continue
        if record.name in MFU_NAMES:
            families["mfu"][(record.name,)] = float(record.value)
        elif record.kind == STEP_TIME:
            families["step_time"][(record.name,)] = float(record.value)
        elif record.kind == THROUGHPUT:
            families["throughput"][(record.name,)] = float(record.value)
        elif record.kind == ACROSS_RANKS:
            metric, _, statistic = record.name.rpartition("/")
            families["across_ranks"][(metric, statistic)] = float(record.value)
    return {"step": step, "time": time.time(), "values": by_step[step], **families}


class AnomalyCounts:
    """Anomalies by (rank, rule) in the dumps under `output_dir`, read again only when a dump changed."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self._seen: Dict[str, Tuple[Tuple[float, int], Dict[str, int]]] = {}

    def counts(self) -> Dict[Tuple[str, str], int]:
        out: Dict[Tuple[str, str], int] = {}
        for path in glob.glob(os.path.join(self.output_dir, ANOMALY_DUMPS)):
            rank = os.path.basename(os.path.dirname(path))[len("rank"):]
            for rule, n in self._by_rule(path).items():
                out[(rank, rule)] = n
        return out

    def _by_rule(self, path: str) -> Dict[str, int]:
        try:
            stat = os.stat(path)
            stamp = (stat.st_mtime, stat.st_size)
            if path in self._seen and self._seen[path][0] == stamp:
                return self._seen[path][1]
            with open(path, encoding="utf-8") as f:
                entries = json.load(f)
        except (OSError, ValueError):   # replaced mid-read: the last count stands until the next scrape
            return self._seen.get(path, (None, {}))[1]
        by_rule: Dict[str, int] = {}
        for entry in entries.values():
            rule = str(entry.get("rule_name", "unknown"))
            by_rule[rule] = by_rule.get(rule, 0) + 1
        self._seen[path] = (stamp, by_rule)
        return by_rule


class _Collector:
    """Builds the families from the sink's latest snapshot, on the server's thread."""

    def __init__(self, sink: "PrometheusSink"):
        self.sink = sink

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        base, values = ["rank", "host", "device", "id"], self.sink.labels + (self.sink.labels[2],)
        latest = self.sink.latest

        def family(name, text, extra=(), rows=()):
            metric = GaugeMetricFamily(name, text, labels=base + list(extra))
            for labels, value in rows:
                metric.add_metric(list(values) + list(labels), value)
            return metric

        if latest is not None:
            yield family("mindmon_step", "The latest training step", rows=[((), latest["step"])])
            yield family("mindmon_last_step_timestamp_seconds", "Unix time when the latest step's records arrived",
                         rows=[((), latest["time"])])
            yield family("mindmon_value", "The latest step's values under their TensorBoard tags", ["tag"],
                         [((tag,), value) for tag, value in latest["values"].items()])
            yield family("mindmon_step_time_seconds", "The step's wall time (phase step) and its phases", ["phase"],
                         latest["step_time"].items())
            yield family("mindmon_throughput", "Samples or tokens per second, this rank's and the job's", ["name"],
                         latest["throughput"].items())
            yield family("mindmon_mfu", "Model (and hardware) FLOPs utilisation", ["name"], latest["mfu"].items())
            yield family("mindmon_across_ranks", "A per-rank value's statistic over the data-parallel ranks",
                         ["metric", "statistic"], latest["across_ranks"].items())
        counts = self.sink.anomalies.counts()
        anomalies = GaugeMetricFamily("mindmon_anomalies", "Anomalies found so far, by alert rule and rank",
                                      labels=["host", "device", "id", "rule", "rank"])
        host, device = self.sink.labels[1], self.sink.labels[2]
        for (rank, rule), n in sorted(counts.items()):
            anomalies.add_metric([host, device, device, rule, rank], n)
        yield anomalies


class PrometheusSink(Sink):
    """Example:
        sink = PrometheusSink(PrometheusConfig(port=9400), "./output/monitor")
        sink.open(RunInfo(rank=0))          # serving on its own thread
        sink.write(records)                 # the step's snapshot: scraped from now on
        sink.close()                        # the server stops
    """

    def __init__(self, section: PrometheusConfig, output_dir: str, logger=None):
        import logging

        self.section = section
        self.logger = logger or logging.getLogger("mindmon")
        self.anomalies = AnomalyCounts(output_dir)
        self.latest: Optional[dict] = None
        self.labels = ("0", socket.gethostname(), "0")
        self.port: Optional[int] = None
        self._server = None
        self._error: Optional[BaseException] = None

    def open(self, run: RunInfo) -> None:
        from mindmon.extras import require

        require("prometheus", "prometheus_client")
        from prometheus_client import CollectorRegistry, start_http_server

        self.labels = (str(run.rank), socket.gethostname(), device_label(run.rank))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        try:
            self._server, _ = start_http_server(self.section.port, self.section.addr, registry)
        except OSError as error:   # a port in use: the run goes on without the endpoint (said at the first write)
            self._error = error
            return
        self.port = self._server.server_port
        self.logger.info("mindmon: Prometheus endpoint at http://%s:%d/metrics", self.section.addr, self.port)

    def write(self, records: Sequence[Record]) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise TrackerError(f"Prometheus: cannot serve on {self.section.addr}:{self.section.port} "
                               f"(monitor.trackers.prometheus): {error}")
        latest = snapshot(records)
        if latest is None:
            return
        previous = self.latest
        if previous is not None and previous["step"] == latest["step"]:   # a second write of the same step
            latest = {key: {**previous[key], **value} if isinstance(value, dict) else value
                      for key, value in latest.items()}
        self.latest = latest   # one reference swap: the server's thread reads whole snapshots

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
