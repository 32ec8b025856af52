"""The `monitor.across_ranks` section."""
from dataclasses import dataclass

from mindmon.config import OnOffSection, setting
from mindmon.config.fields import boolean


@dataclass(frozen=True)
class AcrossRanksConfig(OnOffSection):
    """`monitor.across_ranks`: rank 0 writes, at every step, the min, mean and max over the data-parallel
    ranks of the per-rank values `train_state` and `moe_monitor` collect, and the ranks holding the extremes."""

    enabled: bool = setting(False, boolean())
    """With several data-parallel ranks, rank 0 also writes per step the min, mean and max over the ranks of
    each per-rank value of `train_state` and `moe_monitor`, and the ranks holding the extremes (JSONL kind
    `across_ranks`, TensorBoard `across_ranks/<value>/<statistic>`), carried inside the step's own collectives
    ([multi-rank](multi-rank.md#cross-rank-summaries-live-monitoracross_ranks)); under tensor or context
    parallelism over the data-parallel replicas, of full parameters
    ([model-parallel](model-parallel.md#across-ranks))."""
