"""MindFormers' graph-mode `monitor_config:` section (and the top-level `check_for_nan_in_loss_and_grad`
and `tensorboard:` it works with), validated and mapped onto mindmon's engine.

Defaults and meanings follow MindFormers' `MonitorConfig` / `StableRankConfig` (docs/monitor-config.md).
Nothing here is switched on unless `monitor_on` is True, as in MindFormers; the NaN check is a
top-level key and works on its own.

What each key becomes (each quantity is computed once, by one monitor):
    local_loss_format, device_local_loss_format, local_norm_format  -> monitor.train_state
        (local_loss, device_loss, and local_norm restricted by `target`/`invert` regular expressions)
    device_local_norm_format        -> the global gradient norm the training step already computes
    max_attention_logit_format      -> a MaxLogitsMonitor callback every `step_interval` steps
    optimizer_state_format, weight_state_format, throughput_baseline, stable_rank_config,
    check_for_global_norm, print_struct, check_for_nan_in_loss_and_grad -> mindmon.features.monitor_config.monitors

Example:
    config = MonitorConfigSection.parse("monitor_config", {"monitor_on": True, "local_norm_format": "log",
                                                             "target": ["layers.0"]})
    config.formats["local_norm"]   # frozenset({"log"})
"""
import re
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Optional, Tuple

from mindmon.config import (ConfigError, ParamFilter, Section, check_bool, check_keys, check_positive_number, setting,
                            type_error, value_error)
from mindmon.config.fields import (Check, boolean, custom, keys_of, nested, parse_settings, positive_int, positive_number,
                                   section_dict)

FORMATS = ("log", "tensorboard")
# `<metric>_format` keys, by the metric's short name.
FORMAT_KEYS = ("local_loss", "local_norm", "device_local_norm", "device_local_loss", "optimizer_state",
               "weight_state", "max_attention_logit")
MOE_SHOW_MODES = ("all", "full", "statistics", "none")
TRAIN_STATE_METRICS = ("local_loss", "local_norm", "device_local_loss")


def _formats(path: str, value: Any) -> FrozenSet[str]:
    """`log`, `tensorboard`, a list of them, or None/empty (off)."""
    allowed = f"None (off), one of {list(FORMATS)}, or a list of them"
    if value is None or value == "" or value == []:
        return frozenset()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise type_error(path, value, allowed)
    unknown = [v for v in items if v not in FORMATS]
    if unknown:
        raise value_error(path, value, f"{allowed} (unknown: {unknown})")
    return frozenset(items)


def _patterns(path: str, value: Any) -> Tuple[str, ...]:
    """Regular expressions searched in parameter names; None/empty = every parameter ('.*')."""
    if value is None or value == []:
        return (".*",)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise type_error(path, value, "None (every parameter) or a list of regular expressions")
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as error:
            raise value_error(path, value, f"valid regular expressions ({pattern!r}: {error})") from None
    return tuple(value)


@dataclass(frozen=True)
class RegexFilter(ParamFilter):
    """A `ParamFilter` (what monitor.train_state's monitor takes) selecting by MindFormers' rule: a name
    is selected when any pattern is found in it (`re.search`), the opposite with `invert`."""

    patterns: Tuple[str, ...] = (".*",)
    invert: bool = False
    on: bool = True

    @property
    def enabled(self) -> bool:
        return self.on

    def matches(self, name: str) -> bool:
        return self.on and (any(re.search(p, name) for p in self.patterns) != self.invert)

    def to_yaml(self):
        return {"regex": list(self.patterns), "invert": self.invert} if self.on else False


FORMATS_KIND = "`log`, `tensorboard`, a list of them, or None (off)"


def _dump_path(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise type_error(path, value, "a non-empty directory path")
    return value


def _moe_show_mode(path: str, value: Any) -> str:
    if value not in MOE_SHOW_MODES:
        raise value_error(path, value, f"one of {list(MOE_SHOW_MODES)}")
    return value


def _health_checkpoint(path: str, value: Any) -> Optional[dict]:
    """MindFormers: a `health_checkpoint` with `global_norm_spike_threshold` sets that threshold and
    switches the spike check on when it is non-zero (MonitorConfigSection.parse applies it)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise type_error(path, value, "None or a mapping with global_norm_spike_threshold")
    threshold = value.get("global_norm_spike_threshold")
    if threshold is not None and threshold != 0:
        check_positive_number(f"{path}.global_norm_spike_threshold", threshold,
                              "0/None (check off) or a finite number > 0")
    return dict(value)


def _format_setting() -> Any:
    return setting(frozenset(), custom(FORMATS_KIND, _formats), shown_default="off")


def _given(default: Any, check: Check, **options) -> Any:
    """A MindFormers key: `key: null` keeps the default, as its config templates read it."""
    return setting(default, check, null_is_default=True, **options)


@dataclass(frozen=True)
class StableRankSection(Section):
    formats: FrozenSet[str] = setting(frozenset(), custom(FORMATS_KIND, _formats), key="format", shown_default="off")
    """Stable rank and largest eigenvalue of the selected weights."""

    step_interval: int = _given(100, positive_int())
    """Every N steps."""

    target: Tuple[str, ...] = setting((".*",), custom("list of regular expressions", _patterns), shown_default="all")
    """Regular expressions over parameter names (not inverted by `invert`)."""

    do_aggregation: bool = _given(False, boolean())
    """Accepted; mindmon runs data parallelism only, so every rank holds whole weights and there is nothing
    to aggregate."""

    moe_show_mode: str = _given("all", custom(" or ".join(f"`{m}`" for m in MOE_SHOW_MODES), _moe_show_mode))
    """For a 3-D weight (one matrix per expert): `full` one value per expert, `statistics` their max/min/mean,
    `all` both, `none` neither."""

    power_iteration_num: int = _given(5, positive_int())
    """Power iterations per collection."""

    def selects(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.target)


@dataclass(frozen=True)
class MonitorConfigSection(Section):
    """The parsed `monitor_config` section plus the top-level NaN check."""

    monitor_on: bool = _given(False, boolean())
    """Switches the section on."""

    dump_path: str = _given("./dump", custom("str", _dump_path))
    """Accepted and validated (a non-empty path); unused: graph mode dumps tensors to files there, mindmon
    reads them in memory."""

    target: Tuple[str, ...] = setting((".*",), custom("list of regular expressions", _patterns),
                                      shown_default="all (`['.*']`)")
    """Regular expressions; a parameter is selected when one is found in its name (`re.search`). Selects the
    parameters of `local_norm` and `optimizer_state`."""

    invert: bool = _given(False, boolean())
    """Select the parameters `target` does not match."""

    step_interval: int = _given(1, positive_int())
    """`optimizer_state`, `weight_state`, `throughput_baseline` and the max attention logit are written every
    N steps."""

    local_loss_format: FrozenSet[str] = _format_setting()
    """Loss of each micro-batch."""

    local_norm_format: FrozenSet[str] = _format_setting()
    """Per selected parameter and micro-step, the increment of the accumulated-gradient norm
    (docs/semantics.md `local_norm`)."""

    device_local_norm_format: FrozenSet[str] = _format_setting()
    """The global gradient norm before clipping (the one the training step computes anyway)."""

    device_local_loss_format: FrozenSet[str] = _format_setting()
    """The step's loss: mean of its micro-batch losses (over the ranks too)."""

    optimizer_state_format: FrozenSet[str] = _format_setting()
    """L2 norms of Adam's first and second moments of each selected parameter (with a model-parallel layout:
    of the full parameter's, written by the first tensor-parallel rank)."""

    weight_state_format: FrozenSet[str] = _format_setting()
    """L2 norm of all trainable parameters together (with a model-parallel layout: of the whole model, every
    shard of every stage once; docs/model-parallel.md)."""

    max_attention_logit_format: FrozenSet[str] = _format_setting()
    """The max attention logit per layer and head, their mean and max (a `MaxLogitsMonitor` every
    `step_interval` steps is added unless `callbacks:` declares one, whose interval then counts)."""

    throughput_baseline: Optional[float] = _given(None, positive_number(
        "None (off) or a finite number > 0 (samples/s per device)"), shown_default="off (`None`)")
    """A number > 0: throughput linearity, written to the log and TensorBoard every `step_interval` steps."""

    print_struct: bool = _given(False, boolean())
    """The first step's update is skipped, every trainable parameter name is logged, training stops after
    step 1."""

    check_for_global_norm: bool = _given(False, boolean())
    """The global-norm spike check (below)."""

    global_norm_spike_threshold: float = _given(3.0, positive_number())
    """A step whose global norm is >= this is a spike."""

    global_norm_spike_count_threshold: int = _given(10, positive_int())
    """Consecutive spikes that stop training."""

    stable_rank: StableRankSection = setting(StableRankSection(), nested(StableRankSection),
                                             key="stable_rank_config")

    health_checkpoint: Optional[dict] = setting(None, custom("mapping", _health_checkpoint))
    """A mapping; its `global_norm_spike_threshold` replaces the one above and, when non-zero, switches the
    spike check on (as MindFormers does)."""

    check_for_nan_in_loss_and_grad: bool = False   # the top-level key, read next to the section
    # metrics whose `tensorboard` format fell back to `log` (no TensorBoard directory configured)
    tensorboard_fallback: Tuple[str, ...] = ()

    # Documented by hand next to the section's rows: a top-level key read with it.
    OTHER_KEYS = ("check_for_nan_in_loss_and_grad",)

    @property
    def formats(self) -> Dict[str, FrozenSet[str]]:
        """Where each metric goes, by its short name (FORMAT_KEYS)."""
        return {k: getattr(self, f"{k}_format") for k in FORMAT_KEYS}

    def format(self, metric: str) -> FrozenSet[str]:
        """Where a metric goes ({} = off); everything is off unless monitor_on."""
        return self.formats.get(metric, frozenset()) if self.monitor_on else frozenset()

    @property
    def checks_spikes(self) -> bool:
        return self.monitor_on and self.check_for_global_norm

    @property
    def active(self) -> bool:
        return self.check_for_nan_in_loss_and_grad or (self.monitor_on and (
            any(self.formats.values()) or self.stable_rank.formats or self.throughput_baseline is not None
            or self.print_struct or self.check_for_global_norm))

    def selects(self, name: str) -> bool:
        """MindFormers' `target`/`invert` rule for parameter names."""
        return any(re.search(p, name) for p in self.target) != self.invert

    def norm_filter(self) -> RegexFilter:
        return RegexFilter(patterns=self.target, invert=self.invert, on=bool(self.format("local_norm")))

    @classmethod
    def parse(cls, path: str, raw: Any, check_nan: Any = None) -> "MonitorConfigSection":
        """The section, and `check_nan`: the top-level `check_for_nan_in_loss_and_grad` (None: absent)."""
        values = parse_settings(cls, path, check_keys(path, raw, KEYS))
        threshold = (values.get("health_checkpoint") or {}).get("global_norm_spike_threshold")
        if values.get("health_checkpoint") is not None:
            values["check_for_global_norm"] = threshold not in (None, 0)
            if values["check_for_global_norm"]:
                values["global_norm_spike_threshold"] = float(threshold)
        if check_nan is not None:
            values["check_for_nan_in_loss_and_grad"] = check_bool("check_for_nan_in_loss_and_grad", check_nan)
        return cls(**values)

    def to_dict(self) -> dict:
        out = section_dict(self)
        for key in FORMAT_KEYS:
            out[f"{key}_format"] = out[f"{key}_format"] or None
        out["stable_rank_config"]["format"] = out["stable_rank_config"]["format"] or None
        return {**out, "check_for_nan_in_loss_and_grad": self.check_for_nan_in_loss_and_grad}


KEYS = keys_of(MonitorConfigSection)


def _train_state(section: MonitorConfigSection, current):
    """monitor.train_state as monitor_config asks for it; the mix with monitor.train_state is refused
    (both name the same quantities, and one monitor computes them once)."""
    from mindmon.features.train_state.config import TrainStateConfig

    asked = [m for m in TRAIN_STATE_METRICS if section.format(m)]
    if not asked:
        return current
    if current.active:
        raise ConfigError(f"monitor_config.{asked[0]}_format: got {sorted(section.format(asked[0]))} while "
                          f"monitor.train_state is also set ({current.to_dict()}); allowed: one of the two for the "
                          f"local/device losses and norms (they are the same quantities): switch monitor.train_state "
                          f"off, or drop monitor_config's {', '.join(m + '_format' for m in asked)}")
    return TrainStateConfig(local_norm=section.norm_filter(), local_loss=bool(section.format("local_loss")),
                            device_loss=bool(section.format("device_local_loss")))


def _tensorboard(section: MonitorConfigSection, raw_tensorboard: Any, current):
    """The TensorBoard sink monitor_config's `tensorboard` formats write to: `monitor.tensorboard`
    when it is on, else MindFormers' top-level `tensorboard:` section (its `tensorboard_dir` and
    `tensorboard_queue_size`; its other keys belong to graph-mode features)."""
    from mindmon.config import TensorBoardConfig

    wanted = any("tensorboard" in section.format(m) for m in FORMAT_KEYS) or (
        section.monitor_on and "tensorboard" in section.stable_rank.formats) or (
        section.monitor_on and section.throughput_baseline is not None)
    if current.enabled or not wanted or not isinstance(raw_tensorboard, dict):
        return current
    known = {k: raw_tensorboard[k] for k in ("tensorboard_dir", "tensorboard_queue_size") if k in raw_tensorboard}
    return TensorBoardConfig.parse("tensorboard", known)


def _callbacks(section: MonitorConfigSection, callbacks: tuple) -> tuple:
    """max_attention_logit_format: a MaxLogitsMonitor every `step_interval` steps, unless one is declared."""
    if not section.format("max_attention_logit") or any(c.get("type") == "MaxLogitsMonitor" for c in callbacks):
        return callbacks
    return callbacks + ({"type": "MaxLogitsMonitor", "step_interval": section.step_interval},)


def _without_tensorboard(section: MonitorConfigSection) -> MonitorConfigSection:
    """MindFormers: with no TensorBoard configured, a `tensorboard` format falls back to `log`."""
    import dataclasses

    formats = {f"{k}_format": (v - {"tensorboard"}) | {"log"} if "tensorboard" in v else v
               for k, v in section.formats.items()}
    fallback = [f"{k}_format" for k in FORMAT_KEYS if "tensorboard" in section.format(k)]
    stable = section.stable_rank
    if "tensorboard" in stable.formats:
        stable = dataclasses.replace(stable, formats=(stable.formats - {"tensorboard"}) | {"log"})
        fallback.append("stable_rank_config.format")
    return dataclasses.replace(section, **formats, stable_rank=stable, tensorboard_fallback=tuple(fallback))


def apply_monitor_config(raw: dict, config):
    """`config` (a MindmonConfig) with the `monitor_config` section mapped onto its engine sections."""
    import dataclasses

    if raw.get("monitor_config") is None and raw.get("check_for_nan_in_loss_and_grad") is None:
        return config.with_section("monitor_config", None)
    section = MonitorConfigSection.parse("monitor_config", raw.get("monitor_config"),
                                         raw.get("check_for_nan_in_loss_and_grad"))
    monitor = config.monitor
    tensorboard = _tensorboard(section, raw.get("tensorboard"), monitor.tensorboard)
    if not tensorboard.enabled:
        section = _without_tensorboard(section)
    monitor = dataclasses.replace(monitor, tensorboard=tensorboard,
                                  sections={**monitor.sections, "train_state": _train_state(section, monitor.train_state)})
    config = dataclasses.replace(config, monitor=monitor, callbacks=_callbacks(section, config.callbacks))
    return config.with_section("monitor_config", section)
