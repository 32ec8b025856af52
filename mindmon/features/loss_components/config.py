"""The `monitor.loss_components` section."""
from dataclasses import dataclass

from mindmon.config import Section, setting
from mindmon.config.fields import boolean, integer


@dataclass(frozen=True)
class LossComponentsConfig(Section):
    """`monitor.loss_components`: the parts of the model's loss (language model, load balancing, z-loss,
    MTP), per micro-batch and per step."""

    enabled: bool = setting(False, boolean())
    """Each part of the model's loss (`get_loss_components()`, or handed in by the loop) per micro-batch and
    per step ([semantics](semantics.md#loss-components-loss_components))."""

    max_components: int = setting(16, integer(1, 1024))
    """The most components a model may give: the size of their data-parallel sum, fixed before step 1
    (every rank sends it)."""

    @property
    def active(self) -> bool:
        return self.enabled
