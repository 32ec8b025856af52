"""`mindmon merge RUN_DIR`: one CSV row per (metric, step, micro-step) across the ranks of a run.

Columns: kind, name, step, micro_step, ranks, min, max, mean, max_rank, outlier_rank. For the
per-rank values `local_loss` and `micro_norm` (the norm of one micro-batch's gradient),
`outlier_rank` names a rank whose value is not finite or more than `factor` times the median of
the other ranks' values; empty otherwise. `local_norm` is not judged: an increment of a norm can
be near zero or negative, so ratios of it mean nothing.
List values (per head, per expert) are left out: their rows would not be one number per rank.
`min`, `max` and `mean` are NaN when any rank's value is NaN (a diverging rank shows in the row,
whatever the order the ranks were read in); `max_rank` is the rank of the largest finite value.
Rows are ordered by step, micro-step (step-level values first), kind, name.

Under model parallelism (records carrying a pipeline stage or expert-parallel index above 0) each row
also keys on `pp` and `ep`, two more columns at the end: a stage's (or an expert rank's) parameters are
its own, even when their names repeat on another stage, so their values are never pooled. Tensor- and
context-parallel ranks are pooled like data-parallel ones: a full parameter's norm is written by one
of them only (docs/model-parallel.md), and their other values are copies of the replica's.

DuckDB (mindmon.analysis.sql) gathers each key's values across ranks, a window of steps at a time
(about WINDOW_ROWS records), so memory stays bounded whatever the run's length; numpy computes each
row from the values in rank order (the mean is numpy's, to the last bit). A rank that wrote a key
twice (a JSONL run resumed before its last step) counts twice; merge says how many keys that hit.
A rank whose file cannot be read (a cut Parquet file, a JSONL that is not JSON lines) is named in one line
on `progress` and read from its other file or left out (mindmon.analysis.sql); the other ranks' rows stay.

Example:
    path, flagged = merge("./output")     # ./output/merged.csv
    pandas.read_csv(path)
"""
import csv
import math
import os
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

from mindmon.core.records import LOCAL_LOSS, MICRO_NORM
from mindmon.analysis.sql import DEFAULT_MEMORY_LIMIT, Engine

PER_RANK_KINDS = (LOCAL_LOSS, MICRO_NORM)
COLUMNS = ["kind", "name", "step", "micro_step", "ranks", "min", "max", "mean", "max_rank", "outlier_rank"]
OUTLIER_RANK = COLUMNS.index("outlier_rank")
PLACES = ["pp", "ep"]   # the coordinates whose ranks hold different parameters: keys of a model-parallel run
WINDOW_ROWS = 4_000_000

STEP_ROWS_SQL = "SELECT step, count(*) FROM records WHERE value IS NOT NULL GROUP BY step ORDER BY step"
WINDOW_SQL = """
SELECT kind, name, step, micro_step, list(rank ORDER BY rank) AS ranks, list(value ORDER BY rank) AS vals
FROM records WHERE value IS NOT NULL AND step BETWEEN ? AND ?
GROUP BY kind, name, step, micro_step
ORDER BY step, micro_step NULLS FIRST, kind, name
"""
MODEL_PARALLEL_SQL = "SELECT coalesce(max(pp), 0) > 0 OR coalesce(max(ep), 0) > 0 FROM records"
PLACED_WINDOW_SQL = """
SELECT kind, name, step, micro_step, coalesce(pp, 0) AS pp, coalesce(ep, 0) AS ep,
       list(rank ORDER BY rank) AS ranks, list(value ORDER BY rank) AS vals
FROM records WHERE value IS NOT NULL AND step BETWEEN ? AND ?
GROUP BY kind, name, step, micro_step, coalesce(pp, 0), coalesce(ep, 0)
ORDER BY step, micro_step NULLS FIRST, kind, name, pp, ep
"""


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


def step_windows(step_rows: List[Tuple[int, int]], most: int = WINDOW_ROWS) -> List[Tuple[int, int]]:
    """(first, last) step ranges of at most `most` records each (at least one step)."""
    windows, first, last, rows = [], None, None, 0
    for step, count in step_rows:
        if first is not None and rows + count > most:
            windows.append((first, last))
            first, rows = None, 0
        first = step if first is None else first
        last, rows = step, rows + count
    if first is not None:
        windows.append((first, last))
    return windows


def _block_outliers(kind_mask: np.ndarray, values: np.ndarray, ranks: np.ndarray, factor: float) -> list:
    """outlier() of each row of a (rows x n ranks) block, ranks ascending; None where not judged.
    With every value finite and none negative the rule can only pick the first largest value (removing a
    smaller one leaves the median of the others as large or larger); other rows take outlier() itself."""
    rows, n = values.shape
    found: list = [None] * rows
    if n < 2 or not kind_mask.any():
        return found
    finite = np.isfinite(values)
    first_bad = np.argmax(~finite, axis=1)
    top = np.argmax(values, axis=1)
    lower = np.sort(values, axis=1)[:, :n - 1]   # the others of the largest value
    m = n - 1
    median = lower[:, (m - 1) // 2] if m % 2 else (lower[:, m // 2 - 1] + lower[:, m // 2]) / 2
    top_value = values[np.arange(rows), top]
    with np.errstate(invalid="ignore"):
        flagged = (median > 0) & (top_value > factor * median)
    for i in np.nonzero(kind_mask)[0]:
        if not finite[i].all():
            found[i] = int(ranks[i, first_bad[i]])
        elif flagged[i]:
            found[i] = int(ranks[i, top[i]])
        elif values[i].min() < 0:
            found[i] = outlier(MICRO_NORM, dict(zip(ranks[i].tolist(), values[i].tolist())), factor)
    return found


def _block_max_ranks(values: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """The rank of each row's largest finite value (first in rank order); of its largest value by
    Python's max when none is finite."""
    finite = np.isfinite(values)
    chosen = ranks[np.arange(len(values)), np.argmax(np.where(finite, values, -np.inf), axis=1)]
    for i in np.nonzero(~finite.any(axis=1))[0]:
        per_rank = dict(zip(ranks[i].tolist(), values[i].tolist()))
        chosen[i] = max(per_rank, key=per_rank.get)
    return chosen


def window_rows(table, factor: float) -> Tuple[List[List], int]:
    """The CSV rows of one window's table (WINDOW_SQL's columns), and how many keys had a rank twice."""
    table = table.combine_chunks()
    offsets = table.column("ranks").chunk(0).offsets.to_numpy() if table.num_rows else np.zeros(1, np.int64)
    flat_ranks = table.column("ranks").chunk(0).values.to_numpy() if table.num_rows else np.zeros(0, np.int64)
    flat_values = table.column("vals").chunk(0).values.to_numpy() if table.num_rows else np.zeros(0)
    kinds, names = table.column("kind").to_pylist(), table.column("name").to_pylist()
    steps, micro = table.column("step").to_pylist(), table.column("micro_step").to_pylist()
    counts = np.diff(offsets)
    places = [table.column(c).to_pylist() for c in PLACES if c in table.column_names]
    out: List[Optional[List]] = [None] * table.num_rows
    twice = 0
    for n in np.unique(counts):
        rows = np.nonzero(counts == n)[0]
        gather = offsets[rows][:, None] + np.arange(n)
        values, ranks = flat_values[gather], flat_ranks[gather]
        twice += int((np.diff(ranks, axis=1) == 0).any(axis=1).sum())
        judged = np.array([kinds[i] in PER_RANK_KINDS for i in rows])
        flagged = _block_outliers(judged, values, ranks, factor)
        max_ranks = _block_max_ranks(values, ranks)
        mins, maxs, means = values.min(axis=1), values.max(axis=1), values.mean(axis=1)
        for j, i in enumerate(rows):
            out[i] = [kinds[i], names[i], steps[i], "" if micro[i] is None else micro[i], int(n), float(mins[j]),
                      float(maxs[j]), float(means[j]), int(max_ranks[j]), "" if flagged[j] is None else flagged[j]]
            out[i] += [place[i] for place in places]
    return out, twice


def merge(run_dir: str, output: Optional[str] = None, factor: float = 5.0, memory_limit: str = DEFAULT_MEMORY_LIMIT,
          source: str = "auto", progress=sys.stderr) -> Tuple[str, List[List]]:
    """Writes the table; returns its path and the flagged rows."""
    if factor <= 1:
        raise ValueError(f"factor: got {factor}; allowed: a number > 1")
    output = output or os.path.join(run_dir if os.path.isdir(run_dir) else os.path.dirname(run_dir), "merged.csv")
    flagged, twice = [], 0
    with Engine(run_dir, memory_limit, source=source, progress=progress) as engine, \
            open(output, "w", newline="", encoding="utf-8") as handle:
        windows = step_windows(engine.execute(STEP_ROWS_SQL).fetchall(), WINDOW_ROWS)
        placed = bool(engine.execute(MODEL_PARALLEL_SQL).fetchall()[0][0])
        writer = csv.writer(handle)
        writer.writerow(COLUMNS + (PLACES if placed else []))
        for done, (first, last) in enumerate(windows, start=1):
            query = PLACED_WINDOW_SQL if placed else WINDOW_SQL
            rows, doubled = window_rows(engine.relation(query, [first, last]).to_arrow_table(), factor)
            writer.writerows(rows)
            flagged += [row for row in rows if row[OUTLIER_RANK] != ""]
            twice += doubled
            if progress is not None:
                print(f"mindmon merge: steps {first}-{last} ({done}/{len(windows)}) from {len(engine.ranks())} "
                      f"rank(s)", file=progress, flush=True)
    if twice and progress is not None:
        print(f"mindmon merge: {twice} key(s) written twice by one rank (a resumed run re-ran steps?)", file=progress)
    return output, flagged
