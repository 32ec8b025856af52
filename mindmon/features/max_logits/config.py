"""The `MaxLogitsMonitor` entry of `callbacks:` (MindFormers declares the monitor as a trainer callback):
at most one, with a positive `step_interval`."""
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mindmon.config import ConfigError, check_keys, is_int, value_error

MAX_LOGITS_CALLBACK = "MaxLogitsMonitor"
MAX_LOGITS_RESET = "MaxLogitsReset"   # MindFormers' resetting-only form: step_interval 1, enable_logging False


def check_step_interval(value: Any, path: str = "step_interval") -> int:
    """`MaxLogitsMonitor.step_interval`: a positive int, else ValueError (as upstream)."""
    if not is_int(value) or value <= 0:
        raise value_error(path, value, "a positive int")
    return value


def check_enable_logging(value: Any, path: str = "enable_logging") -> bool:
    """`MaxLogitsMonitor.enable_logging`: a bool, else ValueError (as upstream)."""
    if not isinstance(value, bool):
        raise value_error(path, value, "True or False")
    return value


@dataclass(frozen=True)
class MaxLogitsSection:
    """The max-logit monitor's part of `callbacks:`: None = no MaxLogitsMonitor declared. With
    `enable_logging` False the running max is reset every step and nothing is recorded."""

    step_interval: Optional[int] = None
    enable_logging: bool = True

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
            if item["type"] not in (MAX_LOGITS_CALLBACK, MAX_LOGITS_RESET):
                continue
            allowed = ("type", "step_interval", "enable_logging") if item["type"] == MAX_LOGITS_CALLBACK else ("type",)
            check_keys(f"{path}[{index}]", item, allowed)
            check_step_interval(item.get("step_interval", 1), f"{path}[{index}].step_interval")
            check_enable_logging(item.get("enable_logging", True), f"{path}[{index}].enable_logging")
            if first is not None:
                # Each one resets the model's running max at step end: the second would read a reset max.
                raise ConfigError(f"{path}[{index}]: a second MaxLogitsMonitor (the first is {path}[{first}]);"
                                  f" allowed: one MaxLogitsMonitor (set its step_interval)")
            first = index
        if first is None:
            return cls()
        item = callbacks[first]
        return cls(item.get("step_interval", 1), item["type"] == MAX_LOGITS_CALLBACK and item.get("enable_logging", True))
