"""One process of the msprobe peer comparison: the overhead benchmark's model in an msprobe-style
loop (micro-batch gradients summed, `param.grad` set, `optimizer(grads)`), timed first without
monitoring, then with a TrainerMon attached collecting weights, gradients and Adam moments (or, with
`--monitored activations`, the inputs and outputs of every cell and their gradients).

    python tools/bench_msprobe_peer.py {msprobe|mindmon} OUTPUT_DIR [--steps N] [--tiny] [--monitored activations]

Prints one JSON line: median step seconds off and on. msprobe's TrainerMon patches the optimizer and
cannot be detached, so each implementation gets a process of its own and "off" is measured in that
process before attaching. The ops leave out `norm`: msprobe's aborts training on CPU MindSpore.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PEER_OPS = ["min", "max", "mean", "zeros", "nans"]
# What is monitored: weights, gradients and Adam moments of every parameter; or the inputs and outputs of
# every cell and their gradients (msprobe hooks no cell with empty targets unless all_xy is set).
MONITORED = {"parameters": {"param_distribution": True, "wg_distribution": True, "mv_distribution": True},
             "activations": {"xy_distribution": True, "all_xy": True}}


def _loop_step(work, grad_fn) -> float:
    from mindmon import split_batch

    start = time.perf_counter()
    summed = None
    for micro_batch in split_batch(work.batch, work.size.micro_steps):
        _, grads = grad_fn(*micro_batch)
        summed = grads if summed is None else tuple(a + g for a, g in zip(summed, grads))
    for parameter, grad in zip(work.optimizer.parameters, summed):
        parameter.grad = grad
    work.optimizer(summed)
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("implementation", choices=("msprobe", "mindmon"))
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--monitored", choices=tuple(MONITORED), default="parameters")
    args = parser.parse_args(argv)
    import mindspore as ms
    from mindspore import value_and_grad

    import bench_overhead as bench

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    work = bench.Workload(bench.TINY if args.tiny else bench.BenchSize(bench.BENCH_MODEL), optimizer="AdamW")
    scale = 1.0 / work.size.micro_steps
    grad_fn = value_and_grad(lambda ids, labels: work.loss(ids, labels) * scale, None, work.optimizer.parameters)
    _loop_step(work, grad_fn)   # warm-up
    off = [_loop_step(work, grad_fn) for _ in range(args.steps)]
    if args.implementation == "msprobe":
        from msprobe.mindspore import TrainerMon
    else:
        from mindmon.msprobe import TrainerMon
    args.output_dir.mkdir(parents=True, exist_ok=True)
    config = args.output_dir / "config.json"
    config.write_text(json.dumps({"targets": {}, **MONITORED[args.monitored], "format": "csv", "ops": PEER_OPS}))
    os.environ["MONITOR_OUTPUT_DIR"] = str(args.output_dir / "out")
    monitor = TrainerMon(str(config), params_have_main_grad=False)
    monitor.set_monitor(work.model, grad_acc_steps=work.size.micro_steps, optimizer=work.optimizer)
    _loop_step(work, grad_fn)   # warm-up with monitoring (first files, first hooks)
    on = [_loop_step(work, grad_fn) for _ in range(args.steps)]
    result = {"implementation": args.implementation, "monitored": args.monitored, "off_median_s": statistics.median(off),
              "on_median_s": statistics.median(on), "steps": args.steps}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
