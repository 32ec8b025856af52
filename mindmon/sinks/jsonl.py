"""One JSON object per line, per rank: `<output dir>/rank_<r>/metrics.jsonl`."""
import json
import os
from typing import Iterable

from ..records import Record


def metrics_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, f"rank_{rank}", "metrics.jsonl")


class JsonlSink:
    """Appends records to the rank's metrics file and flushes at every write (= every step end),
    so a crash loses at most the step in flight.

    Example:
        sink = JsonlSink("./output/monitor", rank=0)
        sink.write(records)   # {"step": 1, "micro_step": 0, "rank": 0, "kind": "local_loss", ...}
    """

    def __init__(self, output_dir: str, rank: int, append: bool = False):
        self.path = metrics_path(output_dir, rank)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        # A resumed run appends to the file of the run it continues; a new run starts it afresh.
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, records: Iterable[Record]) -> None:
        for record in records:
            self._file.write(json.dumps(record.to_json()) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
