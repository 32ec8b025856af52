"""The `MaxLogitsMonitor` entry of `callbacks:` (MindFormers declares the monitor as a trainer callback):
at most one, with a positive `step_interval`."""
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mindmon.config import ConfigError, check_keys, is_int, value_error

MAX_LOGITS_CALLBACK = "MaxLogitsMonitor"


def check_step_interval(value: Any, path: str = "step_interval") -> int:
    """`MaxLogitsMonitor.step_interval`: a positive int, else ValueError (as upstream)."""
    if not is_int(value) or value <= 0:
        raise value_error(path, value, "a positive int")
    return value


@dataclass(frozen=True)
class MaxLogitsSection:
    """The max-logit monitor's part of `callbacks:`: None = no MaxLogitsMonitor declared."""

    step_interval: Optional[int] = None

    @property
    def active(self) -> bool:
        return self.step_interval is not None

    def to_dict(self) -> None:
        return None   # it is an entry of `callbacks:`, written there

    @classmethod
    def parse(cls, path: str, callbacks: Optional[Sequence[dict]]) -> "MaxLogitsSection":
        """`callbacks` already checked by the core (a list of mappings, each with a `type` string)."""
        first = None
        for index, item in enumerate(callbacks or ()):
            if item["type"] != MAX_LOGITS_CALLBACK:
                continue
            check_keys(f"{path}[{index}]", item, ("type", "step_interval"))
            check_step_interval(item.get("step_interval", 1), f"{path}[{index}].step_interval")
            if first is not None:
                # Each one resets the model's running max at step end: the second would read a reset max.
                raise ConfigError(f"{path}[{index}]: a second MaxLogitsMonitor (the first is {path}[{first}]);"
                                  f" allowed: one MaxLogitsMonitor (set its step_interval)")
            first = index
        return cls(None if first is None else callbacks[first].get("step_interval", 1))
