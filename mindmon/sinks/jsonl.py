"""JsonlSink: every record, lossless, in `<output_dir>/rank_<r>/metrics.jsonl` (mindmon.formats.jsonl)."""
from typing import List, Sequence

from ..formats import jsonl
from ..records import Record
from .lines import LinesFileSink


class JsonlSink(LinesFileSink):
    """One JSON object per record, flushed at every step end, so a crash loses at most the step in flight.

    Example:
        sink = JsonlSink("./output/monitor")
        sink.open(RunInfo(rank=0))
        sink.write(records)   # {"step": 1, "micro_step": 0, "rank": 0, "kind": "local_loss", ...}
    """

    def file_path(self, rank: int) -> str:
        return jsonl.metrics_path(self.output_dir, rank)

    def lines(self, records: Sequence[Record]) -> List[str]:
        return [jsonl.encode(record) for record in records]
