"""The `monitor.across_ranks` section."""
from dataclasses import dataclass

from mindmon.config import OnOffSection


@dataclass(frozen=True)
class AcrossRanksConfig(OnOffSection):
    """`monitor.across_ranks`: rank 0 writes, at every step, the min, mean and max over the data-parallel
    ranks of the per-rank values `train_state` and `moe_monitor` collect, and the ranks holding the extremes."""
