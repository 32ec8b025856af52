"""`mindmon to-tensorboard`: event files from a run's JSONL, for runs recorded without the sink
(or turned into JSONL by `mindmon parse-log`). Same tags and axes as the live sink.

Example:
    convert("./output/monitor", "./output/tensorboard")   # ./output/tensorboard/rank_0/events.out.tfevents.*
"""
import sys
from itertools import groupby
from typing import List, Tuple

from mindmon.records import SAMPLES, Record
from mindmon.formats.jsonl import metrics_files, read_records
from mindmon.engine import RunInfo
from mindmon.sinks.tensorboard import TensorBoardSink


def run_shape(records: List[Record]) -> Tuple[int, int]:
    """(global batch size or 0, micro-steps per step) as the records tell them: the `samples`
    records give the first, the largest micro_step the second."""
    batch = next((round(r.value / r.step) for r in records if r.kind == SAMPLES and r.step > 0), 0)
    micro = max((r.micro_step + 1 for r in records if r.micro_step is not None), default=1)
    return batch, micro


def convert(run_dir: str, tensorboard_dir: str, progress=sys.stderr) -> List[str]:
    """One event directory per rank under `tensorboard_dir`; returns their paths."""
    written = []
    for rank, path in metrics_files(run_dir):
        records = read_records(path)
        batch, micro = run_shape(records)
        sink = TensorBoardSink(tensorboard_dir)
        sink.open(RunInfo(rank, global_batch_size=batch or None, micro_steps_per_step=micro))
        steps = 0
        for _, step_records in groupby(records, key=lambda r: r.step):   # the JSONL is written step by step
            sink.write(list(step_records))
            sink.flush()
            steps += 1
            if progress is not None and steps % 100 == 0:
                print(f"mindmon to-tensorboard: rank {rank}: {steps} steps", file=progress, flush=True)
        sink.close()
        if progress is not None:
            print(f"mindmon to-tensorboard: rank {rank}: {len(records)} records from {path} -> {sink.log_dir}",
                  file=progress, flush=True)
        written.append(sink.log_dir)
    return written
