"""The `monitor.loss_scale` section."""
from dataclasses import dataclass

from mindmon.config import OnOffSection, setting
from mindmon.config.fields import boolean


@dataclass(frozen=True)
class LossScaleConfig(OnOffSection):
    """`monitor.loss_scale`: per step, the loss scale, whether the gradients overflowed, whether the
    update was skipped, and the running count of skipped steps."""

    enabled: bool = setting(False, boolean())
    """Per step: the loss scale, whether the gradients overflowed, whether the update was skipped, the
    running count of skipped steps ([semantics](semantics.md#loss-scale-and-overflow-loss_scale))."""
