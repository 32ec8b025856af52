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
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from mindmon.config import (ConfigError, ConfigTypeError, Section, check_bool, check_keys, describe, is_int, key_path,
                            setting, type_error, value_error)
from mindmon.config.fields import boolean, custom, integer, keys_of, parse_settings, positive_number
from mindmon.formats.msprobe_csv import RUN_FOLDER_TIME_FORMAT
from mindmon.features.tensor_stats.points import OPS
from mindmon.features.l2.config import CC_KEY, L2_KEYS, CcConfig, L2Config, parse_cc, parse_l2

if TYPE_CHECKING:   # imported where parsed: the alert block pulls in its rules, speed its own section
    from mindmon.features.alerts.config import AlertConfig
    from mindmon.features.speed.config import SpeedConfig

logger = logging.getLogger("mindmon")

# Keys msprobe documents for capabilities mindmon's tensor statistics do not implement; they are accepted
# (a config.json written for msprobe keeps working) and, when they ask for something, say what is missing.
LATER_CAPABILITIES = {"mg_distribution": "gradient/momentum distributions"}

MAX_STEP_COUNT_PER_RECORD = 1000000
ALWAYS_WRITTEN = ("shape", "dtype")   # msprobe accepts them in `ops`; every CSV row has them
FORMATS = ("csv", "api")   # msprobe's MindSpore formats: CSV files, or none (the numbers through its API)


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


@dataclass(frozen=True)
class TensorStatsConfig(Section):
    """What to collect (weights, gradients, optimizer state), which statistics, when, and how to write them:
    msprobe's monitor config.json keys, with msprobe's names and defaults."""

    OTHER_KEYS = ("alert", "speed") + tuple(LATER_CAPABILITIES) + L2_KEYS + (CC_KEY,)

    targets: Tuple[str, ...] = setting((), custom("mapping name -> mapping", _targets),
                                       shown_default="`{}` (every parameter)")
    """Module names from `cells_and_names()` (all their parameters) and parameter names (or a prefix ending at
    a dot: `fc1` selects `fc1.weight`); values are `{}` or activation specs (docs/activations.md). A target
    that selects no parameter the optimizer trains is an error."""

    param_distribution: bool = setting(False, boolean())
    """`param_origin` (each parameter before the step's update) and `param_updated` (after it)."""

    wg_distribution: bool = setting(False, boolean())
    """`grad_unreduced` (before any data-parallel reduction) and `grad_reduced` (what the optimizer gets)."""

    mv_distribution: bool = setting(False, boolean())
    """`exp_avg` and `exp_avg_sq`: Adam's moments before the update."""

    monitor_mbs_grad: bool = setting(False, boolean())
    """`grad_unreduced` per micro-batch instead of accumulated over the step."""

    ur_distribution: bool = setting(False, boolean())
    """`adam_update` and `adam_ratio` (Adam's bias-corrected update and ratio): their `ops` and histograms."""

    mg_direction: bool = setting(False, boolean())
    """`mg_direction`: the share of elements whose gradient and first moment agree in sign."""

    ops: Tuple[str, ...] = setting(("norm",), custom("list of op names", parse_ops), shown_default='`["norm"]`')
    """Statistics, in this order in the CSV; an empty list means `["norm"]`; duplicates are dropped; `shape`
    and `dtype` are accepted and ignored (every file has those columns); an unknown name is an error."""

    eps: float = setting(1e-8, positive_number(kind="finite number > 0"), shown_default="`1e-8`")
    """Threshold of `zeros`."""

    ndigits: int = setting(6, integer(0, 30))
    """Decimal places in the CSV (significant digits with `significant_digits`)."""

    start_step: int = setting(0, integer(0))
    """First step collected (0-based optimizer step)."""

    step_interval: int = setting(1, integer(1))
    """Collect every n-th step from `start_step`."""

    collect_times: int = setting(100000000, integer(0))
    """Stop after this many collected steps (then every hook is detached)."""

    module_ranks: Tuple[int, ...] = setting((), custom("list of ints >= 0", _ranks),
                                            shown_default="`[]` (every rank)")
    """Ranks that collect; other ranks hook nothing."""

    format: str = setting("csv", custom('`"csv"` or `"api"`', _format), shown_default='`"csv"`')
    """msprobe's MindSpore formats: `csv` writes the CSV files; `api` writes none, the numbers come only
    through `generate_wgrad_metrics()` / `generate_xy_metrics()` (and any sink given to
    `TrainerMon.from_config`); alerts and their dump work with both. Anything else is an error (msprobe
    falls back to csv with an error line)."""

    step_count_per_record: int = setting(1, integer(1, MAX_STEP_COUNT_PER_RECORD))
    """Steps per CSV file."""

    squash_name: bool = setting(False, boolean())
    """Row names shortened to their part from the last `layers.`/`embedding(s).`/`final`/`output`/`norm`
    component (`model.decoder.layers.0.mlp.w` -> `layers.0.mlp.w`), parameter and activation rows alike;
    targets match either form; where two names would share a short name, the later keeps its full name (as
    msprobe)."""

    append_output: Tuple[str, ...] = setting((), custom("`[]` or two timestamps", _append_output))
    """Resume into the newest existing run folder of this rank whose timestamp lies between the two (e.g.
    `["Dec03_21-34-40", "Dec03_21-34-42"]`); with none there, a new folder is written and the fact logged."""

    significant_digits: bool = setting(False, boolean())
    """mindmon only: `ndigits` counts significant digits instead of decimal places, so values like
    `exp_avg_sq` (1e-10) are not rounded to `0.0`."""

    alert: Optional["AlertConfig"] = None   # the `alert` block (msprobe's dialect)
    speed: Optional["SpeedConfig"] = None   # mindmon only: the `speed` block (TrainerMon's timing)

    xy_distribution: bool = setting(False, boolean())
    """`actv` / `actv_grad`: the inputs and outputs of the cells `targets` names (or every cell with
    `all_xy`) and their gradients (docs/activations.md)."""

    all_xy: bool = setting(False, boolean())
    """Every cell (a cell named in `targets` with specs collects only what its specs name)."""

    forward_only: bool = setting(False, boolean())
    """Only the forward activations (`actv`)."""

    backward_only: bool = setting(False, boolean())
    """Only the activations' gradients (`actv_grad`); with `forward_only` too, nothing (said once)."""

    xy_specs: Dict[str, Any] = field(default_factory=dict)  # cell name -> {input/output/...: Spec or None}

    print_struct: bool = setting(False, boolean())
    """Write `module_struct.json` after step 0, then stop training."""

    stack_info: bool = setting(False, boolean())
    """`stack_info.csv`: where each cell was called, at the first step."""

    dynamic_on: bool = setting(False, boolean())
    """With `DYNAMIC_MONITOR=True`: switch monitoring on from the next step (docs/activations.md)."""

    later: Dict[str, Any] = field(default_factory=dict)  # keys of later capabilities, as given
    l2: Optional[L2Config] = None           # the L2 features' keys (l2_targets, recording_l2_features, sa_*)
    cc: Optional[CcConfig] = None           # cc_distribution

    @classmethod
    def parse(cls, path: str, raw: Any) -> Optional["TensorStatsConfig"]:
        """`raw`: the keys as a mapping, the path of a config.json, or None (absent: no section)."""
        if raw is None:
            return None
        if isinstance(raw, str):
            return load_config_json(raw, path)
        if not isinstance(raw, dict):
            raise type_error(path or "config", raw, "a mapping of msprobe monitor keys or a config.json path")
        section = check_keys(path, raw, KEYS)
        later = {k: v for k, v in section.items() if k in LATER_CAPABILITIES}
        _check_later(path, later)
        values = parse_settings(cls, path, section)
        from mindmon.features.tensor_stats.activations import parse_xy_specs, warn_forward_and_backward_only

        warn_forward_and_backward_only(path, values)
        return cls(
            **values, alert=_alert(path, section.get("alert")), speed=_speed(path, section.get("speed")), later=later,
            xy_specs=parse_xy_specs(key_path(path, "targets"), section.get("targets", {})),
            l2=parse_l2(path, section), cc=parse_cc(path, section.get(CC_KEY)))

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


# The settings' keys (msprobe's order), then the blocks other parsers read.
KEYS = keys_of(TensorStatsConfig) + TensorStatsConfig.OTHER_KEYS


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
    """msprobe's dialect: the keys of a config.json as a mapping (or the file's path), at the top level
    unless `path` is given (errors name `path.key`). A section is `TensorStatsConfig.parse(path, raw)`."""
    if section is None:
        raise type_error(path or "config", section, "a mapping of msprobe monitor keys or a config.json path")
    return TensorStatsConfig.parse(path, section)


def _alert(path: str, section: Any):
    if section is None:
        return None
    from mindmon.features.alerts.config import AlertConfig

    alert_path = key_path(path, "alert")
    if isinstance(section, dict) and section.get("rules") == []:
        # msprobe loads an empty rule list as "no alerts"; the block's other keys are still checked
        rest = check_keys(alert_path, section, keys_of(AlertConfig))
        for flag in ("dump", "stop_on_anomaly", "skip_nonfinite_update"):
            if flag in rest:
                check_bool(f"{alert_path}.{flag}", rest[flag])
        return AlertConfig(path=alert_path, dialect="msprobe")
    return AlertConfig.parse(alert_path, section, dialect="msprobe")



def _speed(path: str, section: Any):
    """The `speed` block: `monitor.speed`'s keys (docs/speed.md), parsed by that section. TrainerMon's
    config.json only: a YAML has `monitor.speed` itself."""
    if section is None:
        return None
    if path.startswith("monitor."):
        raise ConfigError(f"{key_path(path, 'speed')}: a block of TrainerMon's config.json; allowed here: "
                          f"monitor.speed (docs/speed.md)")
    from mindmon.features.speed.config import SpeedConfig

    return SpeedConfig.parse(key_path(path, "speed"), section)


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
