"""`mindmon merge RUN_DIR`: one CSV row per (metric, step, micro-step) across the ranks of a run.

Columns: kind, name, step, micro_step, ranks, min, max, mean, max_rank, outlier_rank. For the
per-rank values `local_loss` and `micro_norm` (the norm of one micro-batch's gradient),
`outlier_rank` names a rank whose value is not finite or more than `factor` times the median of
the other ranks' values; empty otherwise. `local_norm` is not judged: an increment of a norm can
be near zero or negative, so ratios of it mean nothing.
List values (per head, per expert) are left out: their rows would not be one number per rank.
`min`, `max` and `mean` are NaN when any rank's value is NaN (a diverging rank shows in the row,
whatever the order the ranks were read in); `max_rank` is the rank of the largest finite value.

Example:
    path, flagged = merge("./output")     # ./output/merged.csv
    pandas.read_csv(path)
"""
import csv
import math
import os
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import numpy as np

from mindmon.records import LOCAL_LOSS, MICRO_NORM
from mindmon.formats.jsonl import metrics_files, read_records

PER_RANK_KINDS = (LOCAL_LOSS, MICRO_NORM)
COLUMNS = ["kind", "name", "step", "micro_step", "ranks", "min", "max", "mean", "max_rank", "outlier_rank"]

Key = Tuple[str, str, int, Optional[int]]


def _collect(run_dir: str) -> Dict[Key, Dict[int, float]]:
    values: Dict[Key, Dict[int, float]] = defaultdict(dict)
    files = metrics_files(run_dir)
    for done, (rank, path) in enumerate(files, start=1):
        print(f"mindmon merge: reading rank {rank} ({done}/{len(files)}): {path}", file=sys.stderr)
        for record in read_records(path):
            if not isinstance(record.value, list):
                values[(record.kind, record.name, record.step, record.micro_step)][rank] = float(record.value)
    return values


def outlier(kind: str, per_rank: Dict[int, float], factor: float) -> Optional[int]:
    """The rank whose per-rank value stands out (see the module docstring), or None."""
    if kind not in PER_RANK_KINDS or len(per_rank) < 2:
        return None
    for rank, value in per_rank.items():
        if not math.isfinite(value):
            return rank
    for rank, value in sorted(per_rank.items(), key=lambda item: -item[1]):
        others = np.median([v for r, v in per_rank.items() if r != rank])
        if others > 0 and value > factor * others:
            return rank
    return None


def _row(key: Key, per_rank: Dict[int, float], factor: float) -> List:
    kind, name, step, micro_step = key
    finite = {r: v for r, v in per_rank.items() if math.isfinite(v)} or per_rank
    max_rank = max(finite, key=finite.get)
    flagged = outlier(kind, per_rank, factor)
    values = np.array([per_rank[r] for r in sorted(per_rank)], dtype=np.float64)
    # numpy's min/max/mean are NaN when any rank's value is NaN, whatever the rank order.
    return [kind, name, step, "" if micro_step is None else micro_step, len(per_rank),
            float(values.min()), float(values.max()), float(values.mean()),
            max_rank, "" if flagged is None else flagged]


def merge(run_dir: str, output: Optional[str] = None, factor: float = 5.0) -> Tuple[str, List[List]]:
    """Writes the table; returns its path and the flagged rows."""
    if factor <= 1:
        raise ValueError(f"factor: got {factor}; allowed: a number > 1")
    values = _collect(run_dir)
    order = sorted(values, key=lambda k: (k[2], -1 if k[3] is None else k[3], k[0], k[1]))
    rows = [_row(key, values[key], factor) for key in order]
    output = output or os.path.join(run_dir if os.path.isdir(run_dir) else os.path.dirname(run_dir), "merged.csv")
    with open(output, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
    return output, [row for row in rows if row[-1] != ""]
