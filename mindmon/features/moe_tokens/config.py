"""The `monitor.moe_monitor` section."""
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

from mindmon.config import Section, is_int, setting, type_error, value_error
from mindmon.config.fields import custom, integer, optional


def _target_layers(key: str, layers: Any) -> Union[None, int, Tuple[int, ...]]:
    if isinstance(layers, (list, tuple)):
        if not all(is_int(x) and x >= 0 for x in layers) or not layers:
            raise value_error(key, layers, "a non-empty list of layer ids >= 0")
        repeated = sorted(x for x, n in Counter(layers).items() if n > 1)
        if repeated:
            raise value_error(key, layers, f"distinct layer ids (listed more than once: {repeated[:10]}); "
                                            f"each layer would be counted once per listing")
        return tuple(layers)
    if layers is not None and not is_int(layers):
        raise type_error(key, layers, "None (all MoE layers), an int N (layers 0..N-1) or a list of ints")
    if is_int(layers) and layers <= 0:
        raise value_error(key, layers, "a positive int N (layers 0..N-1)")
    return layers


@dataclass(frozen=True)
class MoEMonitorConfig(Section):
    """`monitor.moe_monitor`: tokens per expert."""

    save_tokens_per_expert_interval: Optional[int] = setting(
        None, optional(integer(1, None, "None (off) or a positive int", kind="int")), shown_default="`None` (off)")
    """Write the micro-steps whose global micro-step count `iter` is a multiple of N; a bool is a
    `TypeError`, 0/negative a `ValueError`."""

    target_layers: Union[None, int, Tuple[int, ...]] = setting(None, custom("int, list[int], None", _target_layers))
    """int N = decoder layers 0..N-1; list = exactly these decoder layer ids (each once); None = every module
    with `tokens_per_expert`, MTP included."""

    layer_pattern: Optional[str] = setting(None, custom("str (a regular expression) or None",
                                                        lambda path, value: _layer_pattern(path, value)))
    """How the model names its decoder layers, one group = the layer id (`"\\\\.blk\\\\.(\\\\d+)\\\\."`); tried before
    the built-in schemes `decoder.layers.<L>`, `model.layers.<L>`, `h.<L>`, `layers.<L>`/`blocks.<L>`; a
    pattern that does not compile or has not exactly one group is a `ConfigError`."""

    @property
    def active(self) -> bool:
        return self.save_tokens_per_expert_interval is not None

    def to_dict(self) -> dict:
        out = super().to_dict()
        if not self.layer_pattern:
            del out["layer_pattern"]   # the upstream keys only, unless mindmon's own is set
        return out


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
