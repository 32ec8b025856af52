"""The collectives mindmon adds under model parallelism: a TP=2 x DP=2 plain loop on four real msrun workers
(CPU, mccl), a Megatron-split MLP, train_state on every parameter. Per rank: how many collectives mindmon
ran per step, by kind (the data-parallel gradient all-reduce, the packed tensor-parallel sum), the time in
them, and the step time with and without the layout's sums (the same loop, `train_state` off, no layout:
every rank reports its shard only). `tools/bench_collectives.py --layout tp` runs it.

Usage (from the repository root):
    PYTHONPATH=. .venv/bin/python tools/bench_layout_collectives.py --hidden 512 --steps 6
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT_MARK = "BENCH_LAYOUT_RESULT "


def _counted(timings: dict):
    """Wraps the layout's packed sum and the data-parallel sum: calls and seconds per step, by kind."""
    from mindmon import distributed
    from mindmon.parallel import reduce

    def wrap(owner, name, kind):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                entry = timings.setdefault(kind, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - start
        setattr(owner, name, timed)

    wrap(reduce, "packed_sum", "model-parallel packed sum")
    wrap(distributed.DataParallel, "sum", "data-parallel gradient all-reduce")


def worker(args) -> None:
    import numpy as np
    import mindspore as ms
    from mindspore import Parameter, Tensor, mint, nn, ops
    from mindspore.communication import get_rank, init

    from mindmon import AccumulatingTrainStep, build_group, parameter_names, parse_sections, split_batch
    from mindmon.parallel import megatron_layout

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    init("mccl")
    layout = megatron_layout(tp=2)
    tp, group_name = layout.index("tp"), layout.groups["tp"].group
    rng = np.random.default_rng(0)
    width = args.hidden

    class Copy(nn.Cell):
        def __init__(self):
            super().__init__()
            self.reduce = ops.AllReduce(group=group_name)

        def construct(self, x):
            return x * 1.0

        def bprop(self, x, out, dout):
            return (self.reduce(dout),)

    class Reduce(Copy):
        def construct(self, x):
            return self.reduce(x)

        def bprop(self, x, out, dout):
            return (dout,)

    def shard(name, shape, dim):
        full = rng.normal(0, 0.05, shape)
        parameter = Parameter(Tensor(np.split(full, 2, axis=dim)[tp].astype(np.float32)), name=name)
        parameter.tensor_model_parallel, parameter.partition_dim = True, dim
        return parameter

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = shard("fc1", (width, 4 * width), 1), shard("fc2", (4 * width, width), 0)
            self.copy, self.reduce = Copy(), Reduce()

        def construct(self, x):
            return (self.reduce(mint.matmul(ops.relu(mint.matmul(self.copy(x), self.fc1)), self.fc2)) ** 2).mean()

    net = MLP()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    timings = {}
    _counted(timings)
    results = {}
    for label, with_layout in (("no layout", False), ("layout", True)):
        config = parse_sections({"monitor": {"output_dir": os.path.join(args.output_dir, label.replace(" ", "_")),
                                             "train_state": {"local_norm": with_layout, "device_norm": with_layout,
                                                             "local_loss": True}}})
        chosen = layout if with_layout else None
        group = build_group(config, model=net, parameter_names=parameter_names(net, optimizer), layout=chosen,
                            data_parallel=layout.data_parallel, rank=layout.rank)
        step = AccumulatingTrainStep(net, optimizer, 2, group, layout=chosen, data_parallel=layout.data_parallel)
        group.setup()
        times = []
        for index in range(args.steps + 1):
            timings.clear()
            batch = (Tensor(rng.normal(size=(8, 16, width)).astype(np.float32)),)
            start = time.perf_counter()
            step(split_batch(batch, 2))
            group.flush(index + 1)
            times.append(time.perf_counter() - start)
        group.close()
        results[label] = {"step_s": statistics.median(times[1:]),
                          "collectives": {k: {"calls": v[0], "ms": v[1] * 1e3} for k, v in timings.items()}}
    print(RESULT_MARK + json.dumps({"rank": int(get_rank()), "results": results}), flush=True)


def launch(args) -> list:
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="bench_layout_"))
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    done = subprocess.run([msrun, "--worker_num=4", "--local_worker_num=4", f"--master_port={args.port}",
                           f"--log_dir={out / 'msrun'}", "--join=True", os.path.abspath(__file__), "--as-rank",
                           "--hidden", str(args.hidden), "--steps", str(args.steps), "--output-dir", str(out)],
                          env=env, capture_output=True, text=True)
    ranks = []
    for log in sorted((out / "msrun").glob("worker_*.log")):
        ranks += [json.loads(line.split(RESULT_MARK, 1)[1]) for line in log.read_text().splitlines() if RESULT_MARK in line]
    if done.returncode or len(ranks) != 4:
        raise SystemExit(f"bench_layout_collectives: the workers failed (exit {done.returncode}): {done.stderr[-1500:]}")
    return sorted(ranks, key=lambda r: r["rank"])


def format_table(ranks: list) -> str:
    lines = ["TP=2 x DP=2 on 4 msrun workers (mccl, CPU): per step, median over the timed steps"]
    for rank in ranks:
        for label, result in rank["results"].items():
            calls = "; ".join(f"{k}: {v['calls']} call(s), {v['ms']:.2f} ms" for k, v in result["collectives"].items())
            lines.append(f"rank {rank['rank']} {label:>9}: step {result['step_s'] * 1e3:8.1f} ms | {calls}")
    lines.append(f"load average at end: {os.getloadavg()[0]:.2f} (the machine may be shared)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--port", type=int, default=8127)
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    if args.as_rank:
        return worker(args)
    print(format_table(launch(args)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
