"""The `monitor.moe_monitor` section."""
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

from mindmon.config import check_keys, is_int, type_error, value_error


@dataclass(frozen=True)
class MoEMonitorConfig:
    """`monitor.moe_monitor`: tokens per expert."""

    save_tokens_per_expert_interval: Optional[int] = None
    target_layers: Union[None, int, Tuple[int, ...]] = None
    layer_pattern: Optional[str] = None   # a regex over module names whose one group is the decoder layer id

    KEYS = ("save_tokens_per_expert_interval", "target_layers", "layer_pattern")

    @property
    def active(self) -> bool:
        return self.save_tokens_per_expert_interval is not None

    @classmethod
    def parse(cls, path: str, section: Any) -> "MoEMonitorConfig":
        section = check_keys(path, section, cls.KEYS)
        interval = section.get("save_tokens_per_expert_interval")
        key = f"{path}.save_tokens_per_expert_interval"
        if interval is not None:
            if not is_int(interval):
                raise type_error(key, interval, "None (off) or a positive int")
            if interval <= 0:
                raise value_error(key, interval, "None (off) or a positive int")
        layers = section.get("target_layers")
        key = f"{path}.target_layers"
        if isinstance(layers, (list, tuple)):
            if not all(is_int(x) and x >= 0 for x in layers) or not layers:
                raise value_error(key, layers, "a non-empty list of layer ids >= 0")
            repeated = sorted(x for x, n in Counter(layers).items() if n > 1)
            if repeated:
                raise value_error(key, layers, f"distinct layer ids (listed more than once: {repeated[:10]}); "
                                                f"each layer would be counted once per listing")
            layers = tuple(layers)
        elif layers is not None and not is_int(layers):
            raise type_error(key, layers, "None (all MoE layers), an int N (layers 0..N-1) or a list of ints")
        elif is_int(layers) and layers <= 0:
            raise value_error(key, layers, "a positive int N (layers 0..N-1)")
        return cls(interval, layers, _layer_pattern(f"{path}.layer_pattern", section.get("layer_pattern")))

    def to_dict(self) -> dict:
        layers = list(self.target_layers) if isinstance(self.target_layers, tuple) else self.target_layers
        out = {"save_tokens_per_expert_interval": self.save_tokens_per_expert_interval, "target_layers": layers}
        return {**out, "layer_pattern": self.layer_pattern} if self.layer_pattern else out   # the upstream keys


def _layer_pattern(path: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    allowed = r"a regular expression over module names with one group, the layer id (r'\.blk\.(\d+)\.')"
    if not isinstance(value, str) or not value:
        raise type_error(path, value, allowed)
    try:
        groups = re.compile(value).groups
    except re.error as error:
        raise value_error(path, value, f"{allowed}; it does not compile: {error}") from None
    if groups != 1:
        raise value_error(path, value, f"{allowed}; it has {groups} groups")
    return value
