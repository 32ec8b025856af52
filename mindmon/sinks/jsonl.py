"""JsonlSink: every record, lossless, in `<output_dir>/rank_<r>/metrics.jsonl` (mindmon.formats.jsonl)."""
import os
from typing import List, Sequence

from mindmon.core.engine import RunInfo
from mindmon.formats import jsonl, parallel_layout
from mindmon.core.records import Record
from mindmon.sinks.lines import LinesFileSink, claim_folder


class JsonlSink(LinesFileSink):
    """One JSON object per record, flushed at every step end, so a crash loses at most the step in flight.

    Example:
        sink = JsonlSink("./output/monitor")
        sink.open(RunInfo(rank=0))
        sink.write(records)   # {"step": 1, "micro_step": 0, "rank": 0, "kind": "local_loss", ...}
    """

    def __init__(self, output_dir: str, config_key: str = "monitor.output_dir", layout=None):
        super().__init__(output_dir, config_key)
        self._lock = None
        self.layout = layout   # mindmon.parallel: each line also carries the rank's coordinates
        self._suffix = parallel_layout.coordinates_suffix(layout) if layout is not None else ""

    def open(self, run: RunInfo) -> None:
        """Refuses a folder another live run is writing (its `run.lock`), before touching its file."""
        lock = claim_folder(os.path.dirname(self.file_path(run.rank)), self.config_key, self.output_dir)
        super().open(run)
        lock.acquire()
        self._lock = lock
        if self.layout is not None:
            parallel_layout.write_layout(self.output_dir, self.layout, run.rank)

    def close(self) -> None:
        super().close()
        if self._lock is not None:
            self._lock.release()

    def file_path(self, rank: int) -> str:
        return jsonl.metrics_path(self.output_dir, rank)

    def lines(self, records: Sequence[Record]) -> List[str]:
        if self._suffix:
            return [line[:-1] + self._suffix + "}" for line in jsonl.encode_many(records)]
        return jsonl.encode_many(records)
