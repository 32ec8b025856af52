"""The `monitor.across_ranks` section."""
from dataclasses import dataclass
from typing import Any

from mindmon.config import check_bool, check_keys


@dataclass(frozen=True)
class AcrossRanksConfig:
    """`monitor.across_ranks`: rank 0 writes, at every step, the min, mean and max over the data-parallel
    ranks of the per-rank values `train_state` and `moe_monitor` collect, and the ranks holding the extremes."""

    enabled: bool = False

    KEYS = ("enabled",)

    @property
    def active(self) -> bool:
        return self.enabled

    @classmethod
    def parse(cls, path: str, section: Any) -> "AcrossRanksConfig":
        section = check_keys(path, section, cls.KEYS)
        return cls(check_bool(f"{path}.enabled", section.get("enabled", False)))

    def to_dict(self) -> dict:
        return {"enabled": self.enabled}
