"""Scale benchmark of the offline tools: synthetic runs in the documented layout, each tool timed as
its own process (wall time, peak RSS), on the JSONL and on the columnar files.

    PYTHONPATH=. .venv/bin/python tools/bench_scale.py --ranks 8 --steps 50 --formats jsonl,parquet
    PYTHONPATH=. .venv/bin/python tools/bench_scale.py --ranks 1024 --steps 100 --formats parquet --tools merge,report

A rank's step holds the demo's train_state records: K `local_loss`, K `local_norm` and K `micro_norm` per
parameter, one `device_norm` per parameter and the `device_loss` (111 parameters and K = 4: 1004 records).
Rank 1 has a NaN loss at step 3 and rank 2 a loss 10x the others at step 5, so the outlier paths run.
The JSONL is written by mindmon's own encoder; the Parquet by mindmon.formats.columnar's writer.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import List, Tuple

import numpy as np

from mindmon.formats import columnar, jsonl
from mindmon.core.records import DEVICE_LOSS, DEVICE_NORM, LOCAL_LOSS, LOCAL_NORM, MICRO_NORM, Record

TOOLS = {
    "merge": lambda run, out: ["merge", run, "-o", os.path.join(out, "merged.csv")],
    "report": lambda run, out: ["report", run, "-o", os.path.join(out, "report.html")],
    "query": lambda run, out: ["query", run, "SELECT kind, count(*), avg(value) FROM records GROUP BY kind",
                               "-o", os.path.join(out, "query.csv")],
    "to-tensorboard": lambda run, out: ["to-tensorboard", run, "-o", os.path.join(out, "tb")],
}
# `compact` (JSONL -> Parquet) runs last on a JSONL run; the other tools read the format under test.
SOURCE = {"jsonl": "jsonl", "parquet": "columnar"}


def tool_argv(tool: str, run: str, out: str, fmt: str) -> List[str]:
    if tool == "compact":
        return ["compact", run]
    return TOOLS[tool](run, out) + ["--source", SOURCE[fmt]]


def parameter_names(count: int) -> List[str]:
    parts = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
             "mlp.linear_fc2.weight", "input_layernorm.weight")
    return [f"decoder.layers.{i // len(parts)}.{parts[i % len(parts)]}" for i in range(count)]


def step_layout(names: List[str], micro: int) -> Tuple[list, list, list]:
    """(kinds, names, micro_steps) of one step's records, in the order the monitor writes them."""
    kinds, labels, micros = [], [], []
    for k in range(micro):
        for kind in (LOCAL_NORM, MICRO_NORM):
            kinds += [kind] * len(names)
            labels += names
            micros += [k] * len(names)
        kinds.append(LOCAL_LOSS)
        labels.append("loss")
        micros.append(k)
    kinds += [DEVICE_NORM] * len(names) + [DEVICE_LOSS]
    labels += names + ["loss"]
    micros += [None] * (len(names) + 1)
    return kinds, labels, micros


def rank_values(rank: int, steps: int, kinds: list, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + rank)
    values = rng.lognormal(-3.0, 1.0, size=(steps, len(kinds)))
    losses = np.array([kind in (LOCAL_LOSS, DEVICE_LOSS) for kind in kinds])
    values[:, losses] = 2.0 + 0.1 * rng.standard_normal((steps, losses.sum()))
    if rank == 1 and steps >= 3:
        values[2, kinds.index(LOCAL_LOSS)] = np.nan
    if rank == 2 and steps >= 5:
        values[4, losses] *= 10
    return values


def write_parquet(path: str, rank: int, steps: int, layout) -> None:
    pa = columnar.pyarrow()
    kinds, labels, micros = layout
    values = rank_values(rank, steps, kinds)
    per_step = len(kinds)
    chunk = max(1, 200_000 // per_step)

    def batches():
        for first in range(0, steps, chunk):
            count = min(chunk, steps - first)
            rows = count * per_step
            data = {"step": np.repeat(np.arange(first + 1, first + count + 1), per_step),
                    "micro_step": pa.array(micros * count, pa.int32()), "rank": np.full(rows, rank, np.int32),
                    "kind": pa.array(kinds * count), "name": pa.array(labels * count),
                    "value": values[first:first + count].ravel()}
            yield pa.table({field.name: data.get(field.name, pa.nulls(rows, field.type))
                            for field in columnar.schema()}).cast(columnar.schema()).to_batches()[0]

    os.makedirs(os.path.dirname(path), exist_ok=True)
    columnar.write_parquet(path, batches())


def write_jsonl(path: str, rank: int, steps: int, layout) -> None:
    kinds, labels, micros = layout
    values = rank_values(rank, steps, kinds)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for s in range(steps):
            handle.write("".join(jsonl.encode(Record(s + 1, m, rank, k, n, float(v))) + "\n"
                                 for k, n, m, v in zip(kinds, labels, micros, values[s])))


def make_run(root: str, fmt: str, ranks: int, steps: int, params: int, micro: int) -> Tuple[int, int]:
    """Writes the run; returns (records, bytes on disk)."""
    layout = step_layout(parameter_names(params), micro)
    for rank in range(ranks):
        if fmt == "parquet":
            write_parquet(columnar.parquet_path(root, rank), rank, steps, layout)
        else:
            write_jsonl(jsonl.metrics_path(root, rank), rank, steps, layout)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
    return ranks * steps * len(layout[0]), size


def peak_rss(argv: List[str]) -> Tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit code) of one tool run as its own process (wait4's rusage: that
    process's own peak, not a sum over children)."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "mindmon", *argv], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code:
        print(err.decode()[-2000:], file=sys.stderr)
    return time.perf_counter() - start, usage.ru_maxrss / 1024, code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--params", type=int, default=111, help="parameters (111: the demo's train_state)")
    parser.add_argument("--micro", type=int, default=4, help="K, micro-batches per step")
    parser.add_argument("--formats", default="jsonl,parquet")
    parser.add_argument("--tools", default="merge,report,query,compact",
                        help=f"from {sorted(TOOLS) + ['compact']}")
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="mindmon-bench-scale-")
    rows = []
    try:
        for fmt in args.formats.split(","):
            run = os.path.join(base, f"{fmt}_{args.ranks}x{args.steps}")
            shutil.rmtree(run, ignore_errors=True)
            start = time.perf_counter()
            records, size = make_run(run, fmt, args.ranks, args.steps, args.params, args.micro)
            print(f"{fmt}: {records} records, {size / 2**20:.1f} MiB, written in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
            tools = [t for t in args.tools.split(",") if t != "compact"]
            tools += ["compact"] if "compact" in args.tools.split(",") and fmt == "jsonl" else []
            for tool in tools:
                out = os.path.join(base, f"out_{fmt}_{tool}")
                os.makedirs(out, exist_ok=True)
                wall, rss, code = peak_rss(tool_argv(tool, run, out, fmt))
                rows.append((f"{args.ranks} x {args.steps}", records, fmt, size, tool, wall, rss, code))
                print(f"  {tool}: {wall:.1f} s, {rss:.0f} MiB, exit {code}", file=sys.stderr, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print("| ranks x steps | records | format | on disk | bytes/record | tool | wall | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for label, records, fmt, size, tool, wall, rss, code in rows:
        print(f"| {label} | {records / 1e6:.2f} M | {fmt} | {size / 2**20:.1f} MiB | {size / records:.1f} | {tool} | "
              f"{wall:.1f} s{'' if code == 0 else f' (exit {code})'} | {rss:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
