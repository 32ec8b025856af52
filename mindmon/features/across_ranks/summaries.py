"""Per-step summaries over the data-parallel ranks of values every rank has one of: the layout of a rank's
row of values (its columns), and the records rank 0 writes from every rank's row."""
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from mindmon.core.records import ACROSS_RANKS, Record

# The statistics of one column over the ranks; `min_rank` / `max_rank` are the data-parallel ranks holding
# the extremes (the first such rank on a tie, and the first rank holding a NaN when there is one).
STATISTICS = ("min", "mean", "max", "min_rank", "max_rank")


@dataclass(frozen=True)
class Column:
    """One value every rank contributes: its micro-step (None for a step-level value) and the name its
    records start with (`local_loss`, `micro_norm/<parameter>`, `tokens_per_expert_step/<layer>/expert_<e>`)."""

    micro_step: Optional[int]
    name: str


def summary_records(step: int, rank: int, columns: Sequence[Column], rows: np.ndarray) -> List[Record]:
    """`rows`: (ranks, columns), row r holding data-parallel rank r's values. Five records per column,
    kind `across_ranks`, named `<column>/<statistic>`."""
    rows = np.asarray(rows, np.float64).reshape(-1, len(columns))
    with np.errstate(invalid="ignore"):
        table = (rows.min(axis=0), rows.mean(axis=0), rows.max(axis=0),
                 _extreme_rank(rows, np.argmin), _extreme_rank(rows, np.argmax))
    records = []
    for index, column in enumerate(columns):
        records += [Record(step, column.micro_step, rank, ACROSS_RANKS, f"{column.name}/{statistic}",
                           float(values[index])) for statistic, values in zip(STATISTICS, table)]
    return records


def _extreme_rank(rows: np.ndarray, arg) -> np.ndarray:
    """numpy's argmin/argmax already answer the first NaN's rank when a column holds one."""
    return arg(rows, axis=0).astype(np.float64)
