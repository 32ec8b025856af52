"""ColumnarSink: every record in `<output_dir>/rank_<r>/metrics.parquet` (mindmon.formats.columnar),
through an Arrow stream flushed at every step end."""
import logging
import os
from typing import Dict, List, Optional, Sequence

from mindmon.config import ConfigError
from mindmon.core.engine import RunInfo, Sink
from mindmon.formats import columnar
from mindmon.formats.run_folder import RunLock, rank_dir
from mindmon.extras import MissingExtraError
from mindmon.core.records import Record
from mindmon.sinks.lines import claim_folder, unwritable

logger = logging.getLogger("mindmon")


class ColumnarSink(Sink):
    """One Arrow record batch per step in `metrics.arrows`, compacted into `metrics.parquet` at close.
    A new run replaces the rank's files; a resumed run keeps the rows of the steps it continues from (up
    to its start step: the Parquet file, and a stream a killed run left, which is compacted first).

    Example:
        sink = ColumnarSink("./output/monitor", coordinates={"dp": 0})
        sink.open(RunInfo(rank=0))
        sink.write(records); sink.flush()    # step 1 is on disk
        sink.close()                         # ./output/monitor/rank_0/metrics.parquet
    """

    def __init__(self, output_dir: str, coordinates: Optional[Dict[str, int]] = None,
                 config_key: str = "monitor.output_dir"):
        self.output_dir = output_dir
        self.coordinates = dict(coordinates or {})
        self.config_key = config_key
        self.rank = 0
        self.resumed_at: Optional[int] = None
        self._stream: Optional[columnar.StreamWriter] = None
        self._pending: List[Record] = []
        self._lock: Optional[RunLock] = None

    def open(self, run: RunInfo) -> None:
        try:
            columnar.pyarrow()
        except MissingExtraError:   # said before step 1
            raise ConfigError(f"monitor.metrics_formats: got 'parquet', which needs pyarrow; allowed: 'jsonl', or "
                              f"install it with `pip install 'mindmon[{columnar.EXTRA}]'`") from None
        self.rank = run.rank
        self.resumed_at = run.start_step if run.resumed else None
        folder = rank_dir(self.output_dir, run.rank)
        lock = claim_folder(folder, self.config_key, self.output_dir)
        try:
            os.makedirs(folder, exist_ok=True)
            if run.resumed:
                columnar.compact(folder)
            else:
                for name in (columnar.PARQUET_FILE, columnar.STREAM_FILE):
                    if os.path.exists(os.path.join(folder, name)):
                        os.remove(os.path.join(folder, name))
            self._stream = columnar.StreamWriter(columnar.stream_path(self.output_dir, run.rank))
        except OSError as error:
            raise unwritable(self.config_key, self.output_dir, folder, error) from None
        lock.acquire()
        self._lock = lock

    def write(self, records: Sequence[Record]) -> None:
        if self._stream is None:
            raise RuntimeError("mindmon: ColumnarSink: write before open()")
        self._pending.extend(records)

    def flush(self) -> None:
        if self._stream is not None and self._pending and not self.closed:
            batch = columnar.record_batch(self._pending, self.rank, self.coordinates)
            self._pending = []
            self._stream.write(batch)

    def close(self) -> None:
        """Compacts the stream (once: the Sink base sees to it). A compaction that fails (a full disk) is
        logged, once, and leaves the stream readable up to its last whole step (`mindmon compact` turns it into Parquet later) and any earlier
        Parquet file as it was; the folder's lock is released anyway."""
        try:
            self.flush()
        finally:
            try:
                if self._stream is not None:
                    try:
                        self._stream.close()
                    finally:
                        self._compact()   # a stream without its end marker reads as well
            finally:
                if self._lock is not None:
                    self._lock.release()

    def _compact(self) -> None:
        folder = rank_dir(self.output_dir, self.rank)
        try:
            columnar.compact(folder, previous_through=self.resumed_at)
        except OSError as error:
            logger.error("mindmon: ColumnarSink: compacting %s into %s failed (%s); the stream is kept, readable "
                         "up to its last whole step: `mindmon compact %s` makes the Parquet file later",
                         columnar.STREAM_FILE, columnar.PARQUET_FILE, getattr(error, "strerror", None) or error,
                         self.output_dir)
