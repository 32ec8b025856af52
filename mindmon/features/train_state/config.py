"""The `monitor.train_state` section."""
from dataclasses import dataclass

from mindmon.config import ParamFilter, Section, setting
from mindmon.config.fields import boolean, custom

PARAMETERS = "bool, str, list[str]"


@dataclass(frozen=True)
class TrainStateConfig(Section):
    """`monitor.train_state`: gradient norms and losses per micro-step."""

    local_norm: ParamFilter = setting(ParamFilter(), custom(PARAMETERS, ParamFilter.parse), shown_default='`""` (off)')
    """Per micro-step, per parameter: increment of the accumulated-gradient norm. `True` = all trainable
    parameters; a string or list = parameter-name substrings (`"layers.0"`); `""`/`False`/`[]` = off."""

    local_loss: bool = setting(False, boolean())
    """Loss of each micro-batch."""

    device_norm: ParamFilter = setting(ParamFilter(), custom(PARAMETERS, ParamFilter.parse))
    """Per parameter: norm of the accumulated gradient (forces the norm collection; filters its own output)."""

    device_loss: bool = setting(False, boolean())
    """Mean of the step's micro-batch losses, recorded after the optimizer update."""

    @property
    def active(self) -> bool:
        return self.local_norm.enabled or self.device_norm.enabled or self.local_loss or self.device_loss
