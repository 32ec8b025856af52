"""`<output>/anomaly_detected/rank<r>/anomaly.json`: msprobe's schema, one entry per (tag,
statistic, step, micro-step), rewritten atomically (temporary file + os.replace) at step end, so
a crash leaves the previous complete file, never half of one."""
import json
import os
from typing import Dict, Iterable

from mindmon.features.alerts.anomaly import Anomaly

DUMP_DIR = "anomaly_detected"
DUMP_FILE = "anomaly.json"


def dump_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, DUMP_DIR, f"rank{rank}", DUMP_FILE)


def write_json_atomically(path: str, data) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=4, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


class AnomalyDump:
    """Example:
        dump = AnomalyDump("./output/monitor", rank=0)
        dump.add(anomalies)
        dump.write()      # only when something was added since the last write
    """

    def __init__(self, output_dir: str, rank: int):
        self.output_dir = output_dir
        self.path = dump_path(output_dir, rank)
        self.entries: Dict[str, dict] = {}
        self._dirty = False

    def set_rank(self, rank: int) -> None:
        self.path = dump_path(self.output_dir, rank)

    def load_existing(self) -> None:
        """A resumed run keeps what the earlier run dumped."""
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                self.entries = {**json.load(f), **self.entries}

    def add(self, anomalies: Iterable[Anomaly]) -> None:
        for anomaly in anomalies:
            key, n = anomaly.key, 1
            while key in self.entries:  # the same record written twice: keep both
                key, n = f"{anomaly.key}_{n}", n + 1
            self.entries[key] = anomaly.to_json()
            self._dirty = True

    def write(self) -> None:
        if self._dirty:
            write_json_atomically(self.path, self.entries)
            self._dirty = False
