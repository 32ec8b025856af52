"""The `monitor.loss_scale` section."""
from dataclasses import dataclass

from mindmon.config import OnOffSection


@dataclass(frozen=True)
class LossScaleConfig(OnOffSection):
    """`monitor.loss_scale`: per step, the loss scale, whether the gradients overflowed, whether the
    update was skipped, and the running count of skipped steps."""
