"""`<output_dir>/rank_<r>/metrics.parquet`: every record of one rank as one Parquet row, the columnar
twin of `metrics.jsonl` (the same records, NaN and inf kept as IEEE floats).

While the run goes, the rank writes `metrics.arrows`: an Arrow IPC stream, one record batch per step,
written and flushed at every step end, so a killed process loses at most the step in flight (the
reader stops at the first incomplete batch). At close the stream is compacted into `metrics.parquet`
(zstd, names dictionary-encoded, values byte-stream-split, row groups of ROW_GROUP_ROWS) and removed.
A stream left by a killed run is compacted by `mindmon compact RUN_DIR`, or when a resumed run opens.

Columns (SCHEMA):

    step INT64, micro_step INT32 (null: a step-level value), rank INT32,
    dp, tp, pp, ep, cp INT32 (the rank's parallel coordinates; null where unknown),
    kind, name VARCHAR, value DOUBLE (a scalar record; null for a list),
    value_list DOUBLE[] (a list record: per head, per expert, or one number per op),
    iteration INT64 (`iter`), ops VARCHAR[] (a tensor-statistics record's ops: value_list[i] is ops[i]),
    shape INT64[], dtype VARCHAR (tensor-statistics records only; ops is null for every other record)

Example:
    for rank, path in columnar_files("./output/monitor"):
        records = read_records(path)                 # the same Records the JSONL reader gives
    # DuckDB: SELECT step, value_list[list_position(ops, 'norm')] FROM 'rank_0/metrics.parquet'
    #         WHERE kind = 'grad_reduced' AND name = 'fc1.weight'
"""
import functools
import glob
import itertools
import os
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from mindmon.extras import require
from mindmon.core.records import Record, TensorStatsRecord
from mindmon.formats.run_folder import rank_dir, rank_in_path
from mindmon.formats.step_file import StepFile

PARQUET_FILE = "metrics.parquet"
STREAM_FILE = "metrics.arrows"
COORDINATES = ("dp", "tp", "pp", "ep", "cp")
ROW_GROUP_ROWS = 16384   # ~16 steps of the demo's train_state: a step range prunes most of a file
EXTRA = "analysis"


def pyarrow():
    return require(EXTRA, "pyarrow")


@functools.lru_cache(maxsize=None)
def schema():
    pa = pyarrow()
    fields = [("step", pa.int64()), ("micro_step", pa.int32()), ("rank", pa.int32())]
    fields += [(axis, pa.int32()) for axis in COORDINATES]
    fields += [("kind", pa.string()), ("name", pa.string()), ("value", pa.float64()),
               ("value_list", pa.list_(pa.float64())), ("iteration", pa.int64()), ("ops", pa.list_(pa.string())),
               ("shape", pa.list_(pa.int64())), ("dtype", pa.string())]
    return pa.schema(fields)


def parquet_path(output_dir: str, rank: int) -> str:
    return os.path.join(rank_dir(output_dir, rank), PARQUET_FILE)


def stream_path(output_dir: str, rank: int) -> str:
    return os.path.join(rank_dir(output_dir, rank), STREAM_FILE)


def record_batch(records: Sequence[Record], rank: int, coordinates: Optional[Dict[str, int]] = None):
    """The records as one batch of SCHEMA; `rank` is the file's rank (the folder's)."""
    pa = pyarrow()
    count = len(records)
    columns: Dict[str, list] = {"step": [r.step for r in records], "micro_step": [r.micro_step for r in records],
                                "rank": [rank] * count}
    for axis in COORDINATES:
        columns[axis] = [(coordinates or {}).get(axis)] * count
    columns["kind"] = [r.kind for r in records]
    columns["name"] = [r.name for r in records]
    lists = [isinstance(r.value, (list, tuple)) for r in records]
    columns["value"] = [None if is_list else float(r.value) for r, is_list in zip(records, lists)]
    columns["value_list"] = [[float(v) for v in r.value] if is_list else None for r, is_list in zip(records, lists)]
    columns["iteration"] = [r.iteration for r in records]
    stats = [isinstance(r, TensorStatsRecord) for r in records]
    columns["ops"] = [list(r.ops) if s else None for r, s in zip(records, stats)]
    columns["shape"] = [list(r.shape) if s else None for r, s in zip(records, stats)]
    columns["dtype"] = [r.dtype if s else None for r, s in zip(records, stats)]
    return pa.RecordBatch.from_pydict(columns, schema=schema())


def records_of(table) -> List[Record]:
    """The Records of a table or batch of SCHEMA (a list value comes back as a list of floats)."""
    columns = table.to_pydict()
    records = []
    for i in range(table.num_rows):
        value = columns["value_list"][i] if columns["value_list"][i] is not None else columns["value"][i]
        fields = (columns["step"][i], columns["micro_step"][i], columns["rank"][i], columns["kind"][i],
                  columns["name"][i], value, columns["iteration"][i])
        if columns["ops"][i] is not None:
            records.append(TensorStatsRecord(*fields, ops=tuple(columns["ops"][i]), shape=tuple(columns["shape"][i]),
                                             dtype=columns["dtype"][i]))
        else:
            records.append(Record(*fields))
    return records


class _Pieces:
    """The file object an Arrow stream writer writes to: it keeps the bytes until `take`, so each batch
    reaches the file in one piece (mindmon.formats.step_file)."""

    closed = False

    def __init__(self):
        self._chunks: List[bytes] = []
        self._position = 0

    def write(self, data) -> int:
        self._chunks.append(bytes(data))
        self._position += len(data)
        return len(data)

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        data, self._chunks = b"".join(self._chunks), []
        return data


class StreamWriter:
    """`metrics.arrows`: one compressed record batch per `write`, on disk (in the kernel's cache) when
    `write` returns, so a SIGKILL after it keeps the batch. A write that fails (a full disk) cuts the file
    back to the last whole batch and raises; the stream then ends there, readable."""

    def __init__(self, path: str):
        pa = pyarrow()
        self.path = path
        self._file = StepFile(path, fresh=True)
        self._pieces = _Pieces()
        options = pa.ipc.IpcWriteOptions(compression="zstd")
        self._writer = pa.ipc.new_stream(pa.PythonFile(self._pieces, mode="w"), schema(), options=options)
        self._failed = False
        self._put()   # the schema

    def _put(self) -> None:
        try:
            self._file.write(self._pieces.take())
        except OSError:
            self._failed = True
            raise

    def write(self, batch) -> None:
        if self._failed:
            raise OSError(f"{self.path}: an earlier write failed; the stream ends at its last whole batch")
        self._writer.write_batch(batch)
        self._put()

    def close(self) -> None:
        try:
            if not self._failed:
                self._writer.close()   # the end-of-stream marker
                self._put()
        finally:
            self._file.close()


def stream_batches(path: str) -> Iterator:
    """The complete batches of a stream; a batch cut by a kill (and whatever follows it) is left out."""
    pa = pyarrow()
    with pa.OSFile(path, "rb") as source:
        try:
            reader = pa.ipc.open_stream(source)
        except (pa.ArrowInvalid, OSError):
            return   # killed before the schema was whole: no step was written
        while True:
            try:
                yield reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError):
                return


def table_batches(path: str) -> Iterator:
    """The batches of a `metrics.parquet` or `metrics.arrows` file."""
    if path.endswith(".arrows"):
        yield from stream_batches(path)
        return
    pq = require(EXTRA, "pyarrow.parquet")
    yield from pq.ParquetFile(path).iter_batches(batch_size=ROW_GROUP_ROWS)


def read_table(path: str):
    pa = pyarrow()
    return pa.Table.from_batches(list(table_batches(path)), schema=schema())


def read_records(path: str) -> List[Record]:
    return records_of(read_table(path))


class ParquetFileWriter:
    """Writes batches of SCHEMA to a Parquet file in row groups of ROW_GROUP_ROWS, to a temporary name
    renamed into place at close (a reader never sees half a file)."""

    def __init__(self, path: str):
        pa, pq = pyarrow(), require(EXTRA, "pyarrow.parquet")
        self.path, self._partial = path, path + ".partial"
        self._pending: list = []
        self._rows = 0
        self._pa = pa
        self._writer = pq.ParquetWriter(self._partial, schema(), compression="zstd",
                                        use_byte_stream_split=["value", "value_list.list.element"])

    def write(self, batch) -> None:
        """A batch of SCHEMA, or of columns that cast to it (DuckDB's)."""
        if batch.schema != schema():
            self._pending += self._pa.Table.from_batches([batch]).cast(schema()).to_batches()
        else:
            self._pending.append(batch)
        self._rows += batch.num_rows
        if self._rows >= ROW_GROUP_ROWS:
            self._write_pending()

    def _write_pending(self) -> None:
        if self._pending:
            table = self._pa.Table.from_batches(self._pending, schema=schema())
            self._writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
        self._pending, self._rows = [], 0

    def close(self) -> None:
        self._write_pending()
        self._writer.close()
        os.replace(self._partial, self.path)

    def abort(self) -> None:
        """Leaves no partial file, whatever failed (a full disk fails the footer too)."""
        try:
            self._writer.close()
        except OSError:
            pass
        finally:
            if os.path.exists(self._partial):
                os.remove(self._partial)


def compact(folder: str, previous_through: Optional[int] = None) -> Optional[str]:
    """`folder/metrics.arrows` (after the rows of an earlier `metrics.parquet` of the run it continues,
    those up to step `previous_through` when given: a resumed run writes the later steps again) into
    `folder/metrics.parquet`; the stream is removed. Returns the Parquet path, None without a stream."""
    stream = os.path.join(folder, STREAM_FILE)
    if not os.path.exists(stream):
        return None
    target = os.path.join(folder, PARQUET_FILE)
    earlier = table_batches(target) if os.path.exists(target) else iter(())
    if previous_through is not None:
        pc = require(EXTRA, "pyarrow.compute")
        earlier = (batch.filter(pc.less_equal(batch.column("step"), previous_through)) for batch in earlier)
    write_parquet(target, itertools.chain(earlier, table_batches(stream)))
    os.remove(stream)
    return target


def write_parquet(path: str, batches: Iterable) -> str:
    """Written to a temporary name and renamed into place: a failure leaves `path` as it was."""
    writer = ParquetFileWriter(path)
    try:
        for batch in batches:
            writer.write(batch)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return path


def columnar_files(run_dir: str) -> List[Tuple[int, str]]:
    """(rank, path) of every `rank_<r>/metrics.parquet` and `rank_<r>/metrics.arrows` at or below
    `run_dir` (a rank may have both: a resumed run still going), sorted by rank then name."""
    if os.path.isfile(run_dir):
        return [(rank_in_path(os.path.dirname(os.path.abspath(run_dir))) or 0, run_dir)]
    found = []
    for name in (PARQUET_FILE, STREAM_FILE):
        for path in glob.glob(os.path.join(run_dir, "**", name), recursive=True):
            rank = rank_in_path(os.path.dirname(path))
            if rank is not None and os.path.basename(os.path.dirname(path)) == f"rank_{rank}":
                found.append((rank, path))
    return sorted(found, key=lambda item: (item[0], not item[1].endswith(".parquet"), item[1]))
