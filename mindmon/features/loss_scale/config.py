"""The `monitor.loss_scale` section."""
from dataclasses import dataclass
from typing import Any

from mindmon.config import check_bool, check_keys


@dataclass(frozen=True)
class LossScaleConfig:
    """`monitor.loss_scale`: per step, the loss scale, whether the gradients overflowed, whether the
    update was skipped, and the running count of skipped steps."""

    enabled: bool = False

    KEYS = ("enabled",)

    @property
    def active(self) -> bool:
        return self.enabled

    @classmethod
    def parse(cls, path: str, section: Any) -> "LossScaleConfig":
        section = check_keys(path, section, cls.KEYS)
        return cls(check_bool(f"{path}.enabled", section.get("enabled", False)))

    def to_dict(self) -> dict:
        return {"enabled": self.enabled}
