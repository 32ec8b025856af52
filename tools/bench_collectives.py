"""What `cc_distribution` costs: a data-parallel training step on two real msrun workers (CPU, mccl), with
and without TrainerMon watching the collectives.

Each worker trains the overhead benchmark's demo model in an msprobe-style data-parallel loop: K
micro-batches, gradients summed, every gradient all-reduced (`ops.AllReduce`, one call per parameter
tensor) and averaged, `optimizer(grads)`. After one warm-up step of each, blocks alternate, one step
each: `off` (no TrainerMon: the collectives are MindSpore's own) and `cc` (a fresh TrainerMon with
`cc_distribution: {enable, cc_pre_hook}` and every op: statistics of each AllReduce's input and output,
written to CSV at the optimizer step; closed after the block, which restores the collectives).

Usage (from the repository root; about 3 minutes on a 2-core CPU with --layers 2):
    PYTHONPATH=. .venv/bin/python tools/bench_collectives.py --layers 2 --rounds 3 --json bench_cc.json
    PYTHONPATH=. .venv/bin/python tools/bench_collectives.py --tiny --rounds 1     # seconds: proves it runs

Columns per rank: median step time off and with cc_distribution, their ratio, the added time, the
time inside mindmon (the collective wrappers without the collective itself, and the optimizer hooks
with the CSV writes) and its share of the `off` step.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULT_MARK = "BENCH_CC_RESULT "


def _timed_collective_calls(timer) -> None:
    """Adds the time spent in mindmon's collective wrapper, minus the collective itself, to `timer`
    (bench-only instrumentation of CollectivePatch.call)."""
    from mindmon.features.collectives.hooks import CollectivePatch

    original = CollectivePatch.call

    def call(patch, api, run, args, kwargs, primitive):
        inside = [0.0]

        def timed_run():
            start = time.perf_counter()
            try:
                return run()
            finally:
                inside[0] += time.perf_counter() - start

        start = time.perf_counter()
        try:
            return original(patch, api, timed_run, args, kwargs, primitive)
        finally:
            timer.in_step += time.perf_counter() - start - inside[0]

    CollectivePatch.call = call


class DataParallelLoop:
    """The demo model in an msprobe-style data-parallel loop on this rank."""

    def __init__(self, size, rank: int, world: int):
        from mindspore import ops, value_and_grad

        import bench_overhead as bench

        self.work = bench.Workload(size, optimizer="AdamW")
        self.world = world
        scale = 1.0 / size.micro_steps
        self.grad_fn = value_and_grad(lambda ids, labels: self.work.loss(ids, labels) * scale, None,
                                      self.work.optimizer.parameters)
        self.all_reduce = ops.AllReduce()

    def step(self) -> float:
        from mindmon import split_batch

        start = time.perf_counter()
        summed = None
        for micro_batch in split_batch(self.work.batch, self.work.size.micro_steps):
            _, grads = self.grad_fn(*micro_batch)
            summed = grads if summed is None else tuple(a + g for a, g in zip(summed, grads))
        reduced = tuple(self.all_reduce(g) / self.world for g in summed)
        self.work.optimizer(reduced)
        return time.perf_counter() - start


def _cc_block(loop, out_dir: Path, block: int, timer) -> float:
    """One step with a fresh TrainerMon watching the collectives (closed after: collectives restored)."""
    from mindmon.msprobe import TrainerMon, parse_tensor_stats

    import bench_overhead as bench

    os.environ["MONITOR_OUTPUT_DIR"] = str(out_dir / f"cc{block}")
    config = parse_tensor_stats({"cc_distribution": {"enable": True, "cc_pre_hook": True}, "ops": bench.ALL_OPS})
    monitor = TrainerMon.from_config(config, params_have_main_grad=False)
    timer.instrument(monitor)
    monitor.set_monitor(loop.work.model, loop.work.size.micro_steps, loop.work.optimizer)
    try:
        timer.in_step = timer.at_end = 0.0
        return loop.step()
    finally:
        monitor.close()


def worker(args) -> None:
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    import bench_overhead as bench

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    init("mccl")
    rank, world = get_rank(), get_group_size()
    size = bench.TINY if args.tiny else bench.BenchSize(bench.BENCH_MODEL).with_model(num_layers=args.layers)
    loop = DataParallelLoop(size, rank, world)
    timer = bench.HookTimer()
    _timed_collective_calls(timer)
    out_dir = Path(args.output_dir) / f"rank{rank}"
    loop.step()
    _cc_block(loop, out_dir, 0, timer)   # warm-up of both
    off, on, in_mindmon = [], [], []
    for block in range(1, args.rounds + 1):
        off.append(loop.step())
        on.append(_cc_block(loop, out_dir, block, timer))
        in_mindmon.append((timer.in_step, timer.at_end))
    result = {"rank": rank, "world": world, "size": loop.work.describe(), "off_s": off, "cc_s": on,
              "in_mindmon_s": in_mindmon, "load_average": os.getloadavg()}
    print(RESULT_MARK + json.dumps(result), flush=True)


def launch(args) -> dict:
    """msrun with two workers running this script with --as-rank; their result lines, summarized."""
    from mindmon.demo.launch import _free_port as free_port

    bin_dir = os.path.dirname(sys.executable)
    out_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="mindmon-bench-cc-"))
    msrun = os.path.join(bin_dir, "msrun") if os.path.exists(os.path.join(bin_dir, "msrun")) else "msrun"
    command = [msrun, f"--worker_num={args.workers}", f"--local_worker_num={args.workers}",
               f"--master_port={free_port()}", f"--log_dir={out_dir / 'msrun'}", "--join=True",
               str(Path(__file__).resolve()), "--as-rank", "--output-dir", str(out_dir), "--layers", str(args.layers),
               "--rounds", str(args.rounds)] + (["--tiny"] if args.tiny else [])
    load_start = os.getloadavg()
    done = subprocess.run(command, capture_output=True, text=True,
                          env=dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
                                   PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                               os.environ.get("PYTHONPATH", "")])))
    ranks = []
    for log in sorted((out_dir / "msrun").glob("worker_*.log")):
        ranks += [json.loads(line.split(RESULT_MARK, 1)[1]) for line in log.read_text().splitlines()
                  if RESULT_MARK in line]
    if done.returncode or len(ranks) != args.workers:
        tails = "".join(log.read_text()[-1500:] for log in (out_dir / "msrun").glob("worker_*.log"))
        raise SystemExit(f"bench_collectives: the msrun workers failed (exit {done.returncode}):\n{done.stderr[-1500:]}"
                         f"{tails}")
    return {"rows": [summarize(r) for r in sorted(ranks, key=lambda r: r["rank"])], "size": ranks[0]["size"],
            "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(), "rounds": args.rounds}


def summarize(rank: dict) -> dict:
    off, on = statistics.median(rank["off_s"]), statistics.median(rank["cc_s"])
    in_step = statistics.median(s for s, _ in rank["in_mindmon_s"])
    at_end = statistics.median(e for _, e in rank["in_mindmon_s"])
    return {"rank": rank["rank"], "off_median_s": off, "cc_median_s": on, "ratio_to_off": on / off,
            "added_ms_per_step": (on - off) * 1e3, "in_step_ms": in_step * 1e3, "at_end_ms": at_end * 1e3,
            "in_mindmon_share_of_off_step": (in_step + at_end) / off}


def format_table(result: dict) -> str:
    size = result["size"]
    lines = [f"cc_distribution on {len(result['rows'])} msrun workers (data parallel, mccl; {size['parameters']:,} "
             f"parameters in {size['parameter_tensors']} tensors, one AllReduce each per step; "
             f"{result['rounds']} rounds of one step each)",
             f"{'rank':>4}{'off step s':>12}{'cc step s':>11}{'x off':>8}{'added ms':>10}{'mindmon ms: step+end':>22}"
             f"{'share of off step':>19}"]
    for row in result["rows"]:
        split = f"{row['in_step_ms']:.1f}+{row['at_end_ms']:.1f}"
        lines.append(f"{row['rank']:>4}{row['off_median_s']:>12.3f}{row['cc_median_s']:>11.3f}"
                     f"{row['ratio_to_off']:>8.3f}{row['added_ms_per_step']:>10.1f}{split:>22}"
                     f"{row['in_mindmon_share_of_off_step']:>19.2%}")
    lines.append(f"load average: {result['load_average_at_start'][0]:.2f} at start, "
                 f"{result['load_average_at_end'][0]:.2f} at end")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Not "--worker": msrun would take it for an abbreviation of its own --worker_num.
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the demo model")
    parser.add_argument("--rounds", type=int, default=3, help="timed blocks of one step each, per configuration")
    parser.add_argument("--tiny", action="store_true", help="a toy model (the numbers mean nothing)")
    parser.add_argument("--output-dir", default=None, help="monitor outputs and msrun logs (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="where the results go")
    parser.add_argument("--layout", choices=["dp", "tp"], default="dp",
                        help="tp: the collectives of a TP=2 x DP=2 layout (tools/bench_layout_collectives.py)")
    args, rest = parser.parse_known_args(argv)
    if args.layout == "tp":
        from bench_layout_collectives import main as layout_main

        return layout_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.as_rank:
        return worker(args)
    result = launch(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(format_table(result))
    return result


if __name__ == "__main__":
    main()
