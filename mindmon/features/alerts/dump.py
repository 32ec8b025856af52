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


def write_text_atomically(path: str, text: str) -> None:
    """Through a temporary file and os.replace: a crash or a full disk leaves the previous file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_json_atomically(path: str, data) -> None:
    write_text_atomically(path, json.dumps(data, indent=4, allow_nan=False))


def _line(key: str, entry: dict) -> str:
    return f"    {json.dumps(key)}: {json.dumps(entry, allow_nan=False)}"


class AnomalyDump:
    """Example:
        dump = AnomalyDump("./output/monitor", rank=0)
        dump.add(anomalies)
        dump.write()      # only when something was added since the last write

    Each entry is encoded once, when added (one line of the file), so that rewriting the file at
    step end costs a join and a write, not an encoding of everything found so far."""

    def __init__(self, output_dir: str, rank: int):
        self.output_dir = output_dir
        self.path = dump_path(output_dir, rank)
        self.entries: Dict[str, str] = {}     # key -> the entry's line in the file
        self._dirty = False

    def set_rank(self, rank: int) -> None:
        self.path = dump_path(self.output_dir, rank)

    def load_existing(self) -> None:
        """A resumed run keeps what the earlier run dumped."""
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                earlier = {key: _line(key, entry) for key, entry in json.load(f).items()}
            self.entries = {**earlier, **self.entries}

    def add(self, anomalies: Iterable[Anomaly]) -> None:
        for anomaly in anomalies:
            key, n = anomaly.key, 1
            while key in self.entries:  # the same record written twice: keep both
                key, n = f"{anomaly.key}_{n}", n + 1
            self.entries[key] = _line(key, anomaly.to_json())
            self._dirty = True

    def write(self) -> None:
        if self._dirty:
            write_text_atomically(self.path, "{\n" + ",\n".join(self.entries.values()) + "\n}\n")
            self._dirty = False


def rank_folder(output_dir: str, rank: int) -> str:
    """`<output>/anomaly_detected/rank<r>`: the dump, the run id and the delivery spools of one rank."""
    return os.path.join(output_dir, DUMP_DIR, f"rank{rank}")


def run_id_of(output_dir: str, rank: int, resumed: bool) -> str:
    """The run's id in the rank's folder (`run_id`): a new one for a fresh run, the earlier one
    for a resumed run. Unwritable folder: an id for this process only."""
    import uuid

    path = os.path.join(rank_folder(output_dir, rank), "run_id")
    if resumed and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            existing = f.read().strip()
        if existing:
            return existing
    run_id = uuid.uuid4().hex
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(run_id + "\n")
    except OSError:
        pass
    return run_id
