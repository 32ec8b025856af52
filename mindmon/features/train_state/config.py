"""The `monitor.train_state` section."""
from dataclasses import dataclass
from typing import Any

from mindmon.config import ParamFilter, check_bool, check_keys


@dataclass(frozen=True)
class TrainStateConfig:
    """`monitor.train_state`: gradient norms and losses per micro-step."""

    local_norm: ParamFilter = ParamFilter()
    local_loss: bool = False
    device_norm: ParamFilter = ParamFilter()
    device_loss: bool = False

    KEYS = ("local_norm", "local_loss", "device_norm", "device_loss")

    @property
    def active(self) -> bool:
        return self.local_norm.enabled or self.device_norm.enabled or self.local_loss or self.device_loss

    @classmethod
    def parse(cls, path: str, section: Any) -> "TrainStateConfig":
        section = check_keys(path, section, cls.KEYS)
        out = {}
        for key in ("local_norm", "device_norm"):
            if key in section:
                out[key] = ParamFilter.parse(f"{path}.{key}", section[key])
        for key in ("local_loss", "device_loss"):
            if key in section:
                out[key] = check_bool(f"{path}.{key}", section[key])
        return cls(**out)

    def to_dict(self) -> dict:
        return {"local_norm": self.local_norm.to_yaml(), "local_loss": self.local_loss,
                "device_norm": self.device_norm.to_yaml(), "device_loss": self.device_loss}
