"""What monitor.across_ranks adds to a step, per part, for a data-parallel group of any size, in one process.

    PYTHONPATH=. .venv/bin/python tools/bench_across_ranks.py --ranks 4,64,1024 --params 111 --micro 4

For each group size N it drives `AcrossRanksMonitor` as rank 0 of N ranks would run it (the training step's
own all-reduce is not run: the summed buffer is made here) and prints, per step:
    columns      values of one rank's row: K losses, the rank's mean loss, K x P micro_norm, P accumulated_norm
    all-reduce   the bytes the buffer adds to the step's packed all-reduce, N x columns x 4
    buffer       this rank's row laid into N x columns zeros (every rank, inside the step)
    summaries    rank 0: the summed rows to the host and min/mean/max/ranks into records (at step end)
    jsonl, tb    rank 0: writing those records (5 per column) to metrics.jsonl and to TensorBoard
Times are medians over --steps steps, in milliseconds.
"""
import argparse
import tempfile
import time

import numpy as np


def monitor_for(ranks: int, params: int):
    from mindmon.config import ParamFilter
    from mindmon.parallel.data_parallel import DataParallel
    from mindmon.features.across_ranks.monitor import AcrossRanksMonitor
    from mindmon.features.train_state.config import TrainStateConfig

    group = DataParallel.single()
    group.size, group.rank = ranks, 0   # rank 0 of `ranks`: the buffer's size and the summaries are its
    config = TrainStateConfig(local_norm=ParamFilter(everything=True), local_loss=True, device_loss=True)
    return AcrossRanksMonitor(config, [f"layer.{p}.weight" for p in range(params)], group, on_host=True)


def one_step(monitor, step: int, micro: int, params: int, rng, sinks) -> dict:
    from mindspore import Tensor

    from mindmon.core.engine import CrossRankPayload
    from mindmon.core.events import GradientSnapshot, MicroBatchGradients, MicroBatchLoss
    from mindmon.kernels.stats import MicroStepNorms

    for k in range(micro):
        monitor.on_event(MicroBatchLoss(k, Tensor(np.float32(rng.random()))))
        squared = MicroStepNorms(rng.random(params), rng.random(params))
        monitor.on_event(MicroBatchGradients(k, GradientSnapshot([], [], squared)))
    times = {}
    start = time.perf_counter()
    buffer = monitor.cross_rank(micro).job
    times["buffer"] = time.perf_counter() - start
    monitor.receive_cross_rank(CrossRankPayload(job=rng.random(buffer.shape[0])))
    start = time.perf_counter()
    records = monitor.collect(step)
    times["summaries"] = time.perf_counter() - start
    for name, sink in sinks.items():
        start = time.perf_counter()
        sink.write(records)
        sink.flush()
        times[name] = time.perf_counter() - start
    return times


def measure(ranks: int, params: int, micro: int, steps: int) -> dict:
    from mindmon.core.engine import RunInfo
    from mindmon.sinks.jsonl import JsonlSink
    from mindmon.sinks.tensorboard import TensorBoardSink

    monitor, rng = monitor_for(ranks, params), np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        sinks = {"jsonl": JsonlSink(f"{folder}/monitor"), "tb": TensorBoardSink(f"{folder}/tensorboard")}
        for sink in sinks.values():
            sink.open(RunInfo(0, micro_steps_per_step=micro))
        samples = [one_step(monitor, step, micro, params, rng, sinks) for step in range(1, steps + 1)]
        for sink in sinks.values():
            sink.close()
    columns = len(monitor.columns(micro))
    row = {"ranks": ranks, "columns": columns, "all-reduce": f"{ranks * columns * 4 / 2**20:.2f} MiB"}
    row.update({part: f"{np.median([s[part] for s in samples]) * 1e3:.2f}" for part in samples[0]})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="4,64,1024", help="comma-separated data-parallel group sizes")
    parser.add_argument("--params", type=int, default=111, help="parameters (the demo's train_state: 111)")
    parser.add_argument("--micro", type=int, default=4, help="micro-steps per step, K")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    rows = [measure(int(n), args.params, args.micro, args.steps) for n in args.ranks.split(",")]
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
