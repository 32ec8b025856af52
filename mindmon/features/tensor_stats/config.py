"""msprobe's monitor config.json: every key validated, with the same key names and defaults.

The same parser serves the YAML route: `parse_tensor_stats(section, "monitor.tensor_stats")` takes the
keys as a mapping (or the path of a config.json) and names errors by their full key path.

Example:
    config = load_config_json("./monitor_config.json")
    config.ops            # ("min", "max", "mean", "norm")
    config.collects(3)    # is optimizer step 3 (0-based) collected?
"""
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, Tuple

from mindmon.config import check_int, ConfigError, ConfigTypeError, check_bool, check_keys, check_positive_number, describe, key_path, is_int, type_error, value_error
from mindmon.formats.msprobe_csv import RUN_FOLDER_TIME_FORMAT
from mindmon.features.tensor_stats.points import OPS
from mindmon.features.l2.config import CC_KEY, L2_KEYS, parse_cc, parse_l2

logger = logging.getLogger("mindmon")

# Keys msprobe documents for capabilities mindmon's tensor statistics do not implement; they are accepted
# (a config.json written for msprobe keeps working) and, when they ask for something, say what is missing.
LATER_CAPABILITIES = {"mg_distribution": "gradient/momentum distributions"}

_DEFAULTS = {
    "targets": {}, "param_distribution": False, "wg_distribution": False, "mv_distribution": False,
    "monitor_mbs_grad": False, "ur_distribution": False, "mg_direction": False, "ops": [], "eps": 1e-8, "ndigits": 6, "start_step": 0, "step_interval": 1,
    "collect_times": 100000000, "module_ranks": [], "format": "csv", "step_count_per_record": 1,
    "squash_name": False, "append_output": [], "significant_digits": False,
    # Activations, module structure, stack capture and dynamic on/off (mindmon/features/tensor_stats/activations.py).
    "xy_distribution": False, "all_xy": False, "forward_only": False, "backward_only": False,
    "print_struct": False, "stack_info": False, "dynamic_on": False,
}
KEYS = tuple(_DEFAULTS) + ("alert",) + tuple(LATER_CAPABILITIES) + L2_KEYS + (CC_KEY,)
MAX_STEP_COUNT_PER_RECORD = 1000000
ALWAYS_WRITTEN = ("shape", "dtype")   # msprobe accepts them in `ops`; every CSV row has them
FORMATS = ("csv", "api")   # msprobe's MindSpore formats: CSV files, or none (the numbers through its API)
XY_FLAGS = ("xy_distribution", "all_xy", "forward_only", "backward_only", "print_struct", "stack_info", "dynamic_on")


@dataclass(frozen=True)
class TensorStatsConfig:
    """What to collect (weights, gradients, optimizer state), which statistics, when, and how to write them."""

    targets: Tuple[str, ...] = ()           # module or parameter names; () = every parameter
    param_distribution: bool = False        # param_origin (before the update) + param_updated (after)
    wg_distribution: bool = False           # grad_unreduced + grad_reduced
    mv_distribution: bool = False           # exp_avg + exp_avg_sq, before the update
    monitor_mbs_grad: bool = False          # grad_unreduced per micro-batch instead of accumulated
    ur_distribution: bool = False           # Adam's bias-corrected update and ratio: ops and histograms
    mg_direction: bool = False              # share of elements whose gradient and first moment agree in sign
    ops: Tuple[str, ...] = ("norm",)
    eps: float = 1e-8
    ndigits: int = 6
    start_step: int = 0
    step_interval: int = 1
    collect_times: int = 100000000
    module_ranks: Tuple[int, ...] = ()      # () = every rank
    format: str = "csv"                     # "api": no CSV files (the numbers through generate_*_metrics)
    step_count_per_record: int = 1
    squash_name: bool = False
    append_output: Tuple[str, ...] = ()     # () or (first, last) run-folder timestamps to append to
    significant_digits: bool = False        # mindmon's opt-in: ndigits counts significant digits
    alert: Any = None                       # mindmon.features.alerts.config.AlertConfig of the `alert` block
    xy_distribution: bool = False           # actv / actv_grad: cells' inputs, outputs and their gradients
    all_xy: bool = False                    # every cell (cells in xy_specs keep their specs)
    forward_only: bool = False
    backward_only: bool = False
    xy_specs: Dict[str, Any] = field(default_factory=dict)  # cell name -> {input/output/...: Spec or None}
    print_struct: bool = False              # write module_struct.json after step 0, then stop training
    stack_info: bool = False                # stack_info.csv: where each cell was called, first step
    dynamic_on: bool = False                # with DYNAMIC_MONITOR=True: switch monitoring on
    later: Dict[str, Any] = field(default_factory=dict)  # keys of later capabilities, as given
    l2: Any = None                          # mindmon.features.l2.config.L2Config (L2 features)
    cc: Any = None                          # mindmon.features.l2.config.CcConfig (cc_distribution)

    @property
    def active(self) -> bool:
        return (self.collects_parameters or self.collects_activations or self.print_struct or self.stack_info
                or self.l2_or_cc_active)

    @property
    def l2_or_cc_active(self) -> bool:
        return (self.l2 is not None and self.l2.active) or (self.cc is not None and self.cc.active)

    @property
    def collects_activations(self) -> bool:
        """xy_distribution, unless forward_only and backward_only are both set (then nothing is collected)."""
        return self.xy_distribution and not (self.forward_only and self.backward_only)

    @property
    def collects_parameters(self) -> bool:
        return self.param_distribution or self.wg_distribution or self.mv_distribution or self.reads_adam_state

    @property
    def reads_adam_state(self) -> bool:
        """ur_distribution or mg_direction: mindmon/features/tensor_stats/optimizer_state.py."""
        return self.ur_distribution or self.mg_direction

    def finished(self, step: int) -> bool:
        """No step from `step` (0-based) on is collected any more: collect_times is reached."""
        return (step - self.start_step) // self.step_interval >= self.collect_times

    @property
    def writes_csv(self) -> bool:
        return self.format == "csv"

    def selects_rank(self, rank: int) -> bool:
        return not self.module_ranks or rank in self.module_ranks

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "later"}

    def collects(self, step: int) -> bool:
        """Step (0-based optimizer step) is collected: from start_step, every step_interval, collect_times times."""
        since = step - self.start_step
        return since >= 0 and since % self.step_interval == 0 and since // self.step_interval < self.collect_times


def load_config_json(path: str, key_path: str = "") -> TensorStatsConfig:
    """Reads and validates an msprobe monitor config.json."""
    return parse_tensor_stats(read_config_json(path, key_path), key_path)


def read_config_json(path: str, key_path: str = ""):
    """The JSON of a config file, unvalidated; a ConfigError when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except OSError as error:
        raise ConfigError(f"{key_path or 'config_file_path'}: cannot read {path!r} ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{key_path or 'config_file_path'}: {path!r} is not valid JSON ({error})") from None


def parse_tensor_stats(section: Any, path: str = "") -> TensorStatsConfig:
    """The keys of an msprobe config.json as a mapping (or a config.json path); errors name `path.key`."""
    if isinstance(section, str):
        return load_config_json(section, path)
    if not isinstance(section, dict):
        raise type_error(path or "config", section, "a mapping of msprobe monitor keys or a config.json path")
    check_keys(path, section, KEYS)
    raw = dict(_DEFAULTS, **{k: v for k, v in section.items() if k in _DEFAULTS})
    later = {k: v for k, v in section.items() if k in LATER_CAPABILITIES}
    _check_later(path, later)
    flags = {key: check_bool(key_path(path, key), raw[key]) for key in
             ("param_distribution", "wg_distribution", "mv_distribution", "monitor_mbs_grad", "ur_distribution",
              "mg_direction",
              "squash_name", "significant_digits") + XY_FLAGS}
    from mindmon.features.tensor_stats.activations import parse_xy_specs, warn_forward_and_backward_only

    warn_forward_and_backward_only(path, flags)
    return TensorStatsConfig(
        targets=_targets(key_path(path, "targets"), raw["targets"]), ops=parse_ops(key_path(path, "ops"), raw["ops"]),
        eps=check_positive_number(key_path(path, "eps"), raw["eps"]),
        ndigits=check_int(key_path(path, "ndigits"), raw["ndigits"], 0, 30),
        start_step=check_int(key_path(path, "start_step"), raw["start_step"], 0, None),
        step_interval=check_int(key_path(path, "step_interval"), raw["step_interval"], 1, None),
        collect_times=check_int(key_path(path, "collect_times"), raw["collect_times"], 0, None),
        module_ranks=_ranks(key_path(path, "module_ranks"), raw["module_ranks"]),
        format=_format(key_path(path, "format"), raw["format"]),
        step_count_per_record=check_int(key_path(path, "step_count_per_record"), raw["step_count_per_record"],
                                        1, MAX_STEP_COUNT_PER_RECORD),
        append_output=_append_output(key_path(path, "append_output"), raw["append_output"]),
        alert=_alert(path, section.get("alert")), later=later,
        xy_specs=parse_xy_specs(key_path(path, "targets"), raw["targets"]),
        l2=parse_l2(path, section), cc=parse_cc(path, section.get(CC_KEY)), **flags)


def _alert(path: str, section: Any):
    if section is None:
        return None
    from mindmon.features.alerts.config import AlertConfig

    alert_path = key_path(path, "alert")
    if isinstance(section, dict) and section.get("rules") == []:
        # msprobe loads an empty rule list as "no alerts"; the block's other keys are still checked
        rest = check_keys(alert_path, section, AlertConfig.KEYS)
        for flag in ("dump", "stop_on_anomaly", "skip_nonfinite_update"):
            if flag in rest:
                check_bool(f"{alert_path}.{flag}", rest[flag])
        return AlertConfig(path=alert_path, dialect="msprobe")
    return AlertConfig.parse(alert_path, section, dialect="msprobe")



def _check_later(path: str, later: Dict[str, Any]) -> None:
    """Type-checks keys of later capabilities, and says once which capability a key that asks for
    something needs."""
    needed: Dict[str, list] = {}
    for key, value in later.items():
        if not isinstance(value, bool):
            raise type_error(key_path(path, key), value, "a bool")
        if value:
            needed.setdefault(LATER_CAPABILITIES[key], []).append(key_path(path, key))
    for capability, keys in needed.items():
        logger.warning("mindmon: %s accepted but not acted on: it needs %s, which mindmon's tensor "
                       "statistics do not provide yet", ", ".join(keys), capability)


def _targets(path: str, value: Any) -> Tuple[str, ...]:
    if not isinstance(value, dict):
        raise type_error(path, value, 'a mapping {"module or parameter name": {}}; {} = everything')
    for name, spec in value.items():
        if not isinstance(name, str):
            raise type_error(path, name, "module or parameter names (strings) as keys")
        if not isinstance(spec, dict):
            raise type_error(f"{path}.{name}", spec, "a mapping ({} or activation input/output specs)")
    return tuple(name for name in value if name != "")


def parse_ops(path: str, value: Any) -> Tuple[str, ...]:
    if not isinstance(value, list):
        raise type_error(path, value, f"a list of statistics from {list(OPS)}")
    bad = [op for op in value if op not in OPS + ALWAYS_WRITTEN]
    if bad:
        raise value_error(path, bad[0], f"statistics from {list(OPS)} (and {list(ALWAYS_WRITTEN)}, always written)")
    # Duplicates dropped, config order kept; shape and dtype are columns of every file anyway.
    ops = tuple(op for op in dict.fromkeys(value) if op not in ALWAYS_WRITTEN)
    return ops or ("norm",)


def _ranks(path: str, value: Any) -> Tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(is_int(r) and r >= 0 for r in value):
        raise type_error(path, value, "a list of rank numbers (ints >= 0); [] = every rank")
    return tuple(value)


def _format(path: str, value: Any) -> str:
    if value not in FORMATS:
        raise (ConfigTypeError if not isinstance(value, str) else ConfigError)(
            f"{path}: got {describe(value)}; allowed: 'csv' or 'api' (no files: the numbers through "
            f"generate_wgrad_metrics / generate_xy_metrics; TensorBoard and JSONL come from mindmon's own sinks)")
    return value


def _append_output(path: str, value: Any) -> Tuple[str, ...]:
    allowed = "[] or two run-folder timestamps like [\"Dec03_21-34-40\", \"Dec03_21-34-42\"]"
    if not isinstance(value, list):
        raise type_error(path, value, allowed)
    if len(value) not in (0, 2):
        raise value_error(path, value, allowed)
    for stamp in value:
        try:
            datetime.strptime(stamp, RUN_FOLDER_TIME_FORMAT)
        except (TypeError, ValueError):
            raise value_error(path, stamp, allowed) from None
    return tuple(value)
