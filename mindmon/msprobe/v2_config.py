"""msprobe's monitor_v2 config.json (`TrainerMonitorV2`), every key checked before training.

    {"framework": "mindspore", "output_dir": "./monitor_v2_output", "rank": [0],
     "start_step": 0, "step_interval": 1, "step_count_per_record": 1, "collect_times": 100000000,
     "format": "csv", "async_write": false, "patch_optimizer_step": true,
     "monitors": {"module": {"enabled": true, "targets": ["fc"], "ops": ["min", "max"]},
                  "weight_grad": {"enabled": true, "monitor_mbs_grad": false},
                  "optimizer": {"enabled": true}, "param": {"enabled": true}, "cc": {"enabled": false}}}

Defaults are msprobe's. Where msprobe warns and falls back (an unknown op, a bad rank list, a bad
step_count_per_record), mindmon stops with one line naming the key, the value and what is allowed.
"""
import json
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from mindmon.config import check_int, ConfigError, check_bool, check_keys, is_int, is_number, type_error, value_error

FRAMEWORKS = {"mindspore": "mindspore", "ms": "mindspore"}
OTHER_FRAMEWORKS = ("pytorch", "pt", "torch")
V2_OPS = ("min", "max", "mean", "norm", "nans", "zeros")
DEFAULT_OPS = ("min", "max", "mean", "norm", "nans")
MONITORS = ("module", "weight_grad", "optimizer", "param", "cc")
MAX_STEP_COUNT_PER_RECORD = 1_000_000
DEFAULT_COLLECT_TIMES = 100_000_000
TOP_KEYS = ("framework", "output_dir", "rank", "start_step", "step_interval", "step_count_per_record",
            "collect_times", "stop_step", "format", "async_write", "patch_optimizer_step", "monitors")
MONITOR_KEYS = {
    "module": ("enabled", "targets", "ops", "eps"),
    "weight_grad": ("enabled", "ops", "eps", "monitor_mbs_grad", "micro_batch_number", "grad_acc_steps"),
    "optimizer": ("enabled", "ops", "eps", "mv_distribution"),
    "param": ("enabled", "ops", "eps", "param_distribution"),
    "cc": ("enabled", "ops", "eps", "cc_distribution", "cc_codeline", "cc_log_only", "cc_pre_hook", "module_ranks"),
}


@dataclass(frozen=True)
class MonitorV2:
    """One enabled entry of `monitors`: its ops (msprobe's order, duplicates dropped) and its own keys."""

    name: str
    ops: Tuple[str, ...]
    eps: float
    options: Dict[str, Any]


@dataclass(frozen=True)
class ConfigV2:
    framework: str
    output_dir: str
    ranks: Tuple[int, ...]                 # () = every rank
    start_step: int
    step_interval: int
    step_count_per_record: int
    collect_times: int
    stop_step: int
    async_write: bool
    patch_optimizer_step: Optional[bool]  # None: on when start() is given an optimizer (msprobe's default)
    monitors: Dict[str, MonitorV2]

    def selects_rank(self, rank: int) -> bool:
        return not self.ranks or rank in self.ranks

    def collects(self, step: int, collected_so_far: int) -> bool:
        """msprobe's window: start_step <= step < stop_step, every step_interval-th, at most collect_times."""
        if collected_so_far >= self.collect_times or not self.start_step <= step < self.stop_step:
            return False
        return (step - self.start_step) % self.step_interval == 0

    @property
    def collected_steps(self) -> int:
        """How many steps the window holds at most (collect_times, or fewer when stop_step ends it first)."""
        in_window = -(-(self.stop_step - self.start_step) // self.step_interval)
        return max(0, min(self.collect_times, in_window))


def load_config_v2(path: Any, fr: Optional[str] = None) -> ConfigV2:
    if not isinstance(path, str):
        raise type_error("config_path", path, "the path of the monitor_v2 config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except OSError as error:
        raise ConfigError(f"config_path: got {path!r}, which cannot be read ({error.strerror}); allowed: the path "
                          f"of a readable config.json") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"config_path: {path} is not JSON ({error.msg} at line {error.lineno}); allowed: a JSON "
                          f"object") from None
    return parse_config_v2(raw, fr)


def parse_config_v2(raw: Any, fr: Optional[str] = None) -> ConfigV2:
    if not isinstance(raw, dict):
        raise type_error("config_path", raw, "a config.json holding a JSON object")
    raw = check_keys("", raw, TOP_KEYS)
    start = check_int("start_step", raw.get("start_step", 0), 0)
    interval = check_int("step_interval", raw.get("step_interval", 1), 1)
    collect_times = check_int("collect_times", raw.get("collect_times", DEFAULT_COLLECT_TIMES), 1)
    stop = raw.get("stop_step")
    stop = start + collect_times * interval if stop is None else check_int("stop_step", stop, start)
    fmt = raw.get("format", "csv")
    if not isinstance(fmt, str) or fmt.strip().lower() != "csv":
        raise value_error("format", fmt, '"csv" (monitor_v2 writes CSV only)')
    patch = raw.get("patch_optimizer_step")
    return ConfigV2(framework=_framework(raw, fr), output_dir=_output_dir(raw.get("output_dir", "./")),
                    ranks=_ranks(raw.get("rank", [])), start_step=start, step_interval=interval,
                    step_count_per_record=check_int("step_count_per_record", raw.get("step_count_per_record", 1), 1,
                                               MAX_STEP_COUNT_PER_RECORD),
                    collect_times=collect_times, stop_step=stop,
                    async_write=check_bool("async_write", raw.get("async_write", False)),
                    patch_optimizer_step=None if patch is None else check_bool("patch_optimizer_step", patch),
                    monitors=_monitors(raw.get("monitors", {})))


def _framework(raw: dict, fr: Optional[str]) -> str:
    """`fr` wins over the config's `framework`, as in msprobe; mindmon monitors MindSpore only."""
    key, value = ("fr", fr) if fr is not None else ("framework", raw.get("framework", "mindspore"))
    name = value.strip().lower() if isinstance(value, str) else value
    if name not in FRAMEWORKS:
        hint = " (mindmon monitors MindSpore; PyTorch runs keep msprobe)" if name in OTHER_FRAMEWORKS else ""
        raise value_error(key, value, f'"mindspore" or "ms"{hint}')
    return FRAMEWORKS[name]


def _output_dir(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise type_error("output_dir", value, "a folder path (a non-empty str)")
    return value


def _ranks(value: Any) -> Tuple[int, ...]:
    if is_int(value) and value >= 0:
        return (value,)
    if not isinstance(value, list) or not all(is_int(r) and r >= 0 for r in value):
        raise type_error("rank", value, "an int >= 0 or a list of them ([] = every rank)")
    return tuple(dict.fromkeys(value))


def _monitors(value: Any) -> Dict[str, MonitorV2]:
    section = check_keys("monitors", value, MONITORS)
    enabled = {}
    for name, entry in section.items():
        path = f"monitors.{name}"
        entry = check_keys(path, entry, MONITOR_KEYS[name])
        # msprobe switches `module` on when its entry has no `enabled`, the others off
        if check_bool(f"{path}.enabled", entry.get("enabled", name == "module")):
            enabled[name] = MonitorV2(name, _ops(f"{path}.ops", entry.get("ops")), _eps(f"{path}.eps", entry),
                                      _options(path, name, entry))
    return enabled


def _ops(path: str, value: Any) -> Tuple[str, ...]:
    if value is None:
        return DEFAULT_OPS
    requested = [value] if isinstance(value, str) else value
    if not isinstance(requested, list) or not requested:
        raise type_error(path, value, f"a non-empty list of statistics from {list(V2_OPS)}")
    bad = [op for op in requested if op not in V2_OPS]
    if bad:
        raise value_error(path, bad[0], f"statistics from {list(V2_OPS)}")
    return tuple(dict.fromkeys(requested))


def _eps(path: str, entry: dict) -> float:
    value = entry.get("eps", 1e-8)
    if not is_number(value) or not value > 0 or value == float("inf"):
        raise type_error(path, value, "a finite number > 0")
    return float(value)


def _options(path: str, name: str, entry: dict) -> Dict[str, Any]:
    options: Dict[str, Any] = {}
    if name == "module":
        targets = entry.get("targets", [])
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise type_error(f"{path}.targets", targets, "a list of cell-name keywords ([] = every cell)")
        options["targets"] = tuple(targets)
    if name == "cc":
        entry = _cc_entry(path, entry)
        options["cc_codeline"] = _codeline(f"{path}.cc_codeline", entry.get("cc_codeline", []))
        options["module_ranks"] = _module_ranks(f"{path}.module_ranks", entry.get("module_ranks", []))
    for flag in ("monitor_mbs_grad", "mv_distribution", "param_distribution", "cc_log_only", "cc_pre_hook"):
        if flag in entry:
            options[flag] = check_bool(f"{path}.{flag}", entry[flag])
    for count in ("micro_batch_number", "grad_acc_steps"):
        if count in entry:
            options[count] = check_int(f"{path}.{count}", entry[count], 1)
    return options


CC_KEYS = ("cc_codeline", "cc_log_only", "cc_pre_hook", "module_ranks")


def _cc_entry(path: str, entry: dict) -> dict:
    """monitor_v2 takes the cc keys from a nested `cc_distribution` mapping when there is one."""
    if "cc_distribution" not in entry:
        return entry
    nested = check_keys(f"{path}.cc_distribution", entry["cc_distribution"], CC_KEYS)
    return dict(nested, **{k: v for k, v in entry.items() if k not in CC_KEYS and k != "cc_distribution"})


def _codeline(path: str, value: Any) -> Tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise type_error(path, value, 'a list of regular expressions like "train.py\\\\[23\\\\]"')
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as error:
            raise value_error(path, pattern, f"valid regular expressions ({error})") from None
    return tuple(value)


def _module_ranks(path: str, value: Any) -> Tuple[int, ...]:
    if not isinstance(value, list) or not all(is_int(r) and r >= 0 for r in value):
        raise type_error(path, value, "a list of ranks, ints >= 0 ([] = every rank)")
    return tuple(value)
