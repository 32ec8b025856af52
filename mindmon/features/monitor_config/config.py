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
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Optional, Tuple

from mindmon.config import ConfigError, ParamFilter, check_bool, check_positive_number, check_keys, is_int, type_error, value_error

FORMATS = ("log", "tensorboard")
# `<metric>_format` keys, by the metric's short name.
FORMAT_KEYS = ("local_loss", "local_norm", "device_local_norm", "device_local_loss", "optimizer_state",
               "weight_state", "max_attention_logit")
KEYS = ("monitor_on", "dump_path", "target", "invert", "step_interval", *(f"{k}_format" for k in FORMAT_KEYS),
        "throughput_baseline", "print_struct", "check_for_global_norm", "global_norm_spike_threshold",
        "global_norm_spike_count_threshold", "stable_rank_config", "health_checkpoint")
STABLE_RANK_KEYS = ("format", "step_interval", "target", "do_aggregation", "moe_show_mode", "power_iteration_num")
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


def _positive_int(path: str, value: Any) -> int:
    if not is_int(value):
        raise type_error(path, value, "a positive int")
    if value <= 0:
        raise value_error(path, value, "a positive int")
    return value


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


@dataclass(frozen=True)
class StableRankSection:
    formats: FrozenSet[str] = frozenset()
    step_interval: int = 100
    target: Tuple[str, ...] = (".*",)
    do_aggregation: bool = False
    moe_show_mode: str = "all"
    power_iteration_num: int = 5

    @classmethod
    def parse(cls, path: str, section: Any) -> "StableRankSection":
        section = check_keys(path, section, STABLE_RANK_KEYS)
        out = {"formats": _formats(f"{path}.format", section.get("format")),
               "target": _patterns(f"{path}.target", section.get("target"))}
        for key in ("step_interval", "power_iteration_num"):
            if section.get(key) is not None:
                out[key] = _positive_int(f"{path}.{key}", section[key])
        if section.get("do_aggregation") is not None:
            out["do_aggregation"] = check_bool(f"{path}.do_aggregation", section["do_aggregation"])
        mode = section.get("moe_show_mode")
        if mode is not None:
            if mode not in MOE_SHOW_MODES:
                raise value_error(f"{path}.moe_show_mode", mode, f"one of {list(MOE_SHOW_MODES)}")
            out["moe_show_mode"] = mode
        return cls(**out)

    def selects(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.target)


@dataclass(frozen=True)
class MonitorConfigSection:
    """The parsed `monitor_config` section plus the top-level NaN check."""

    monitor_on: bool = False
    dump_path: str = "./dump"
    target: Tuple[str, ...] = (".*",)
    invert: bool = False
    step_interval: int = 1
    formats: Dict[str, FrozenSet[str]] = field(default_factory=dict)
    throughput_baseline: Optional[float] = None
    print_struct: bool = False
    check_for_global_norm: bool = False
    global_norm_spike_threshold: float = 3.0
    global_norm_spike_count_threshold: int = 10
    stable_rank: StableRankSection = StableRankSection()
    health_checkpoint: Optional[dict] = None
    check_for_nan_in_loss_and_grad: bool = False
    # metrics whose `tensorboard` format fell back to `log` (no TensorBoard directory configured)
    tensorboard_fallback: Tuple[str, ...] = ()

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
    def parse(cls, path: str, section: Any, check_nan: Any = None) -> "MonitorConfigSection":
        section = check_keys(path, section, KEYS)
        out: Dict[str, Any] = {"formats": {k: _formats(f"{path}.{k}_format", section.get(f"{k}_format"))
                                           for k in FORMAT_KEYS},
                               "target": _patterns(f"{path}.target", section.get("target"))}
        for key in ("monitor_on", "invert", "print_struct", "check_for_global_norm"):
            if section.get(key) is not None:
                out[key] = check_bool(f"{path}.{key}", section[key])
        if section.get("dump_path") is not None:
            if not isinstance(section["dump_path"], str) or not section["dump_path"]:
                raise type_error(f"{path}.dump_path", section["dump_path"], "a non-empty directory path")
            out["dump_path"] = section["dump_path"]
        for key in ("step_interval", "global_norm_spike_count_threshold"):
            if section.get(key) is not None:
                out[key] = _positive_int(f"{path}.{key}", section[key])
        if section.get("throughput_baseline") is not None:
            out["throughput_baseline"] = check_positive_number(f"{path}.throughput_baseline", section["throughput_baseline"],
                                                          "None (off) or a finite number > 0 (samples/s per device)")
        if section.get("global_norm_spike_threshold") is not None:
            out["global_norm_spike_threshold"] = check_positive_number(f"{path}.global_norm_spike_threshold",
                                                                  section["global_norm_spike_threshold"])
        out.update(_health_checkpoint(f"{path}.health_checkpoint", section.get("health_checkpoint")))
        out["stable_rank"] = StableRankSection.parse(f"{path}.stable_rank_config", section.get("stable_rank_config"))
        if check_nan is not None:
            out["check_for_nan_in_loss_and_grad"] = check_bool("check_for_nan_in_loss_and_grad", check_nan)
        return cls(**out)

    def to_dict(self) -> dict:
        sr = self.stable_rank
        return {"monitor_on": self.monitor_on, "dump_path": self.dump_path, "target": list(self.target),
                "invert": self.invert, "step_interval": self.step_interval,
                **{f"{k}_format": sorted(self.formats.get(k, ())) or None for k in FORMAT_KEYS},
                "throughput_baseline": self.throughput_baseline, "print_struct": self.print_struct,
                "check_for_global_norm": self.check_for_global_norm,
                "global_norm_spike_threshold": self.global_norm_spike_threshold,
                "global_norm_spike_count_threshold": self.global_norm_spike_count_threshold,
                "stable_rank_config": {"format": sorted(sr.formats) or None, "step_interval": sr.step_interval,
                                       "target": list(sr.target), "do_aggregation": sr.do_aggregation,
                                       "moe_show_mode": sr.moe_show_mode,
                                       "power_iteration_num": sr.power_iteration_num},
                "health_checkpoint": self.health_checkpoint,
                "check_for_nan_in_loss_and_grad": self.check_for_nan_in_loss_and_grad}


def _health_checkpoint(path: str, value: Any) -> dict:
    """MindFormers: a `health_checkpoint` with `global_norm_spike_threshold` sets that threshold and
    switches the spike check on when it is non-zero."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise type_error(path, value, "None or a mapping with global_norm_spike_threshold")
    threshold = value.get("global_norm_spike_threshold")
    if threshold is None or threshold == 0:
        return {"health_checkpoint": dict(value), "check_for_global_norm": False}
    threshold = check_positive_number(f"{path}.global_norm_spike_threshold", threshold,
                                 "0/None (check off) or a finite number > 0")
    return {"health_checkpoint": dict(value), "check_for_global_norm": True, "global_norm_spike_threshold": threshold}


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

    formats = {k: (v - {"tensorboard"}) | {"log"} if "tensorboard" in v else v for k, v in section.formats.items()}
    fallback = [f"{k}_format" for k in FORMAT_KEYS if "tensorboard" in section.format(k)]
    stable = section.stable_rank
    if "tensorboard" in stable.formats:
        stable = dataclasses.replace(stable, formats=(stable.formats - {"tensorboard"}) | {"log"})
        fallback.append("stable_rank_config.format")
    return dataclasses.replace(section, formats=formats, stable_rank=stable, tensorboard_fallback=tuple(fallback))


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
