"""`mindmon to-tensorboard`: event files from a run's records (JSONL or columnar), for runs recorded
without the sink (or turned into JSONL by `mindmon parse-log`). Same tags and axes as the live sink.

Each rank's records come from DuckDB (mindmon.analysis.sql) in file order, a batch at a time, so
memory does not grow with the run.

Example:
    convert("./output/monitor", "./output/tensorboard")   # ./output/tensorboard/rank_0/events.out.tfevents.*
"""
import sys
from typing import Iterator, List, Tuple

from mindmon.core.engine import RunInfo
from mindmon.formats.columnar import records_of
from mindmon.core.records import SAMPLES, Record
from mindmon.sinks.tensorboard import TensorBoardSink
from mindmon.analysis.sql import DEFAULT_MEMORY_LIMIT, Engine

BATCH_ROWS = 65536


def run_shape(records: List[Record]) -> Tuple[int, int]:
    """(global batch size or 0, micro-steps per step) as the records tell them: the `samples`
    records give the first, the largest micro_step the second."""
    batch = next((round(r.value / r.step) for r in records if r.kind == SAMPLES and r.step > 0), 0)
    micro = max((r.micro_step + 1 for r in records if r.micro_step is not None), default=1)
    return batch, micro


def rank_shape(engine: Engine, rank: int) -> Tuple[int, int]:
    """run_shape() of one rank's records, asked of the engine."""
    source = engine.rank_sql(rank)
    first = engine.first(f"SELECT value, step FROM ({source}) WHERE kind = ? AND step > 0 LIMIT 1", [SAMPLES])
    micro = engine.first(f"SELECT max(micro_step) FROM ({source})")[0]
    return (round(first[0] / first[1]) if first else 0), (1 if micro is None else micro + 1)


def steps_of(engine: Engine, rank: int) -> Iterator[List[Record]]:
    """The rank's records step by step, in file order (the files are written step by step)."""
    reader = engine.relation(engine.rank_sql(rank)).to_arrow_reader(BATCH_ROWS)
    step, pending = None, []
    for batch in reader:
        for record in records_of(batch):
            if record.step != step and pending:
                yield pending
                pending = []
            step = record.step
            pending.append(record)
    if pending:
        yield pending


def convert(run_dir: str, tensorboard_dir: str, progress=sys.stderr, memory_limit: str = DEFAULT_MEMORY_LIMIT,
            source: str = "auto") -> List[str]:
    """One event directory per rank under `tensorboard_dir`; returns their paths."""
    written = []
    with Engine(run_dir, memory_limit, source=source) as engine:
        for rank in engine.ranks():
            batch, micro = rank_shape(engine, rank)
            sink = TensorBoardSink(tensorboard_dir)
            sink.open(RunInfo(rank, global_batch_size=batch or None, micro_steps_per_step=micro))
            steps = records = 0
            for step_records in steps_of(engine, rank):
                sink.write(step_records)
                sink.flush()
                steps, records = steps + 1, records + len(step_records)
                if progress is not None and steps % 100 == 0:
                    print(f"mindmon to-tensorboard: rank {rank}: {steps} steps", file=progress, flush=True)
            sink.close()
            if progress is not None:
                print(f"mindmon to-tensorboard: rank {rank}: {records} records -> {sink.log_dir}", file=progress,
                      flush=True)
            written.append(sink.log_dir)
    return written
