"""The config.json keys of the L2 features (`l2_targets`, `recording_l2_features`, `sa_order`, and mindmon's
`sa_causal`) and of the communication-operator statistics (`cc_distribution`), validated; errors name the
key path, the value and what is allowed.

Example:
    l2 = parse_l2("monitor.tensor_stats", {"l2_targets": {"linear_hook": []}, "recording_l2_features": True})
    l2.active, l2.linear_targets     # True, () = every cell with a 2-D `weight` or `wg`
    cc = parse_cc("cc_distribution", {"enable": True, "cc_codeline": ["train.py\\\\[23\\\\]"]})
"""
import logging
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from mindmon.config import ConfigError, check_bool, check_keys, key_path, type_error, value_error

logger = logging.getLogger("mindmon")
L2_KEYS = ("l2_targets", "recording_l2_features", "sa_order", "sa_causal")
CC_KEY = "cc_distribution"
L2_HOOKS = ("attention_hook", "linear_hook")
SA_ORDERS = ("s,b,h,d", "b,s,h,d")
CC_FIELDS = {"enable": False, "cc_codeline": [], "cc_pre_hook": False, "cc_log_only": False}


@dataclass(frozen=True)
class L2Config:
    attention_targets: Tuple[str, ...] = ()          # () = no attention features
    linear_targets: Optional[Tuple[str, ...]] = None  # None = none; () = every cell with a 2-D weight/wg
    recording: bool = False                          # recording_l2_features
    sa_order: str = "s,b,h,d"                        # layout of the attention cell's Q and K inputs
    causal: bool = True                              # sa_causal: mask keys after the query
    path: str = ""                                   # where the keys were read ("monitor.tensor_stats"), for errors

    @property
    def active(self) -> bool:
        return self.recording and (bool(self.attention_targets) or self.linear_targets is not None)


@dataclass(frozen=True)
class CcConfig:
    enable: bool = False
    codeline: Tuple[str, ...] = ()    # regular expressions matched against call-stack lines `file.py[line]`
    pre_hook: bool = False            # also the inputs, before the call
    log_only: bool = False            # log each call once, no statistics, stop before the 2nd optimizer step

    @property
    def active(self) -> bool:
        return self.enable


def parse_l2(path: str, section: Dict[str, Any]) -> L2Config:
    """The L2 keys of an msprobe config mapping (absent keys take msprobe's defaults)."""
    targets = section.get("l2_targets", {})
    if not isinstance(targets, dict):
        raise type_error(key_path(path, "l2_targets"), targets,
                          'a mapping {"attention_hook": [cell names], "linear_hook": [cell names]}')
    for hook, names in targets.items():
        where = key_path(path, f"l2_targets.{hook}")
        if hook not in L2_HOOKS:
            raise ConfigError(f"{where}: unknown hook; allowed: {list(L2_HOOKS)}")
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise type_error(where, names, "a list of cell names (non-empty strings) from cells_and_names()")
    order = section.get("sa_order", "s,b,h,d")
    if not isinstance(order, str) or order.replace(" ", "") not in SA_ORDERS:
        raise value_error(key_path(path, "sa_order"), order, f"one of {list(SA_ORDERS)}")
    linear = targets.get("linear_hook")
    return L2Config(attention_targets=tuple(targets.get("attention_hook", ())),
                    linear_targets=None if linear is None else tuple(linear),
                    recording=check_bool(key_path(path, "recording_l2_features"), section.get("recording_l2_features", False)),
                    sa_order=order.replace(" ", ""),
                    causal=check_bool(key_path(path, "sa_causal"), section.get("sa_causal", True)), path=path)


def parse_cc(path: str, value: Any) -> CcConfig:
    """`cc_distribution`: {"enable", "cc_codeline", "cc_pre_hook", "cc_log_only"}; absent = switched off."""
    path = key_path(path, CC_KEY)
    if value is None:
        return CcConfig()
    if not isinstance(value, dict):
        raise type_error(path, value, f"a mapping with keys {list(CC_FIELDS)}")
    check_keys(path, value, tuple(CC_FIELDS))
    raw = dict(CC_FIELDS, **value)
    codeline = raw["cc_codeline"]
    if not isinstance(codeline, list) or not all(isinstance(c, str) for c in codeline):
        raise type_error(f"{path}.cc_codeline", codeline, 'a list of regular expressions like "train.py\\\\[23\\\\]"')
    for pattern in codeline:
        try:
            re.compile(pattern)
        except re.error as error:
            raise value_error(f"{path}.cc_codeline", pattern, f"valid regular expressions ({error})") from None
    return CcConfig(enable=check_bool(f"{path}.enable", raw["enable"]), codeline=tuple(codeline),
                    pre_hook=check_bool(f"{path}.cc_pre_hook", raw["cc_pre_hook"]),
                    log_only=check_bool(f"{path}.cc_log_only", raw["cc_log_only"]))


_warned = set()


def warn_once(key, message: str, *args) -> None:
    """A run-time failure of the L2 or collective hooks, said once per key; training goes on."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)
