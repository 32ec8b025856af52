"""The `monitor.loss_components` section."""
from dataclasses import dataclass
from typing import Any

from mindmon.config import check_bool, check_int, check_keys


@dataclass(frozen=True)
class LossComponentsConfig:
    """`monitor.loss_components`: the parts of the model's loss (language model, load balancing, z-loss,
    MTP), per micro-batch and per step."""

    enabled: bool = False
    max_components: int = 16   # the size of the data-parallel sum, fixed before step 1 (every rank sends it)

    KEYS = ("enabled", "max_components")

    @property
    def active(self) -> bool:
        return self.enabled

    @classmethod
    def parse(cls, path: str, section: Any) -> "LossComponentsConfig":
        section = check_keys(path, section, cls.KEYS)
        out = {}
        if "enabled" in section:
            out["enabled"] = check_bool(f"{path}.enabled", section["enabled"])
        if "max_components" in section:
            out["max_components"] = check_int(f"{path}.max_components", section["max_components"], low=1,
                                              high=1024)
        return cls(**out)

    def to_dict(self) -> dict:
        return {"enabled": self.enabled, "max_components": self.max_components}
