"""The `monitor`, `profiler` and `callbacks` sections: defaults, validation and clear errors.

Every check runs before step 1, and every error names the full key path, the value it got and
what is allowed.

Example:
    cfg = parse_sections({"monitor": {"train_state": {"local_norm": ["attention"], "local_loss": True}}})
    cfg.monitor.train_state.local_norm.matches("decoder.layers.0.self_attention.linear_qkv.weight")  # True
"""
import math
from collections import Counter
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import yaml

DEFAULT_OUTPUT_DIR = "./output/monitor"


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names the key, the value and what is allowed."""


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value has the wrong type."""


MAX_SHOWN_VALUE = 120  # characters of a value an error message quotes: a 1e6-item list stays one short line


def short_repr(value: Any) -> str:
    """`repr(value)`, cut to MAX_SHOWN_VALUE characters with the item count when longer."""
    text = repr(value)
    if len(text) > MAX_SHOWN_VALUE:
        size = f"{len(value)} items" if isinstance(value, (list, tuple, dict)) else f"{len(text)} characters"
        text = f"{text[:MAX_SHOWN_VALUE - 20]}... ({size})"
    return text


def _describe(value: Any) -> str:
    return f"{short_repr(value)} ({type(value).__name__})"


def _type_error(path: str, value: Any, allowed: str) -> ConfigTypeError:
    return ConfigTypeError(f"{path}: got {_describe(value)}; allowed: {allowed}")


def _value_error(path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{path}: got {_describe(value)}; allowed: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_keys(path: str, section: Any, allowed: Tuple[str, ...]) -> Dict[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise _type_error(path, section, f"a mapping with keys {list(allowed)}")
    unknown = [k for k in section if k not in allowed]
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; allowed keys: {list(allowed)}")
    return section


def _directory(path: str, value: Any, allowed: str) -> str:
    """A directory path: a non-empty string without NUL (the OS would refuse it only at the first write)."""
    if not isinstance(value, str) or not value:
        raise _type_error(path, value, allowed)
    if "\0" in value:
        raise _value_error(path, value, f"{allowed}, without NUL characters")
    return value


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(path, value, "True or False")
    return value


@dataclass(frozen=True)
class ParamFilter:
    """Which parameters a norm switch selects: all trainable ones, those whose name contains any
    of `substrings`, or none (off)."""

    substrings: Tuple[str, ...] = ()
    everything: bool = False

    @property
    def enabled(self) -> bool:
        return self.everything or bool(self.substrings)

    def matches(self, name: str) -> bool:
        return self.everything or any(s in name for s in self.substrings)

    def to_yaml(self) -> Union[bool, List[str]]:
        return True if self.everything else (list(self.substrings) if self.substrings else False)

    @classmethod
    def parse(cls, path: str, value: Any) -> "ParamFilter":
        allowed = 'True (all trainable parameters), a name substring, a list of substrings, or ""/False (off)'
        if isinstance(value, bool):
            return cls(everything=value)
        if isinstance(value, str):
            return cls(substrings=(value,) if value else ())
        if isinstance(value, (list, tuple)):
            for item in value:
                if not isinstance(item, str):
                    raise _type_error(f"{path} item", item, "strings only")
                if not item:
                    raise _value_error(f"{path} item", item, "non-empty substrings (use True to select all)")
            return cls(substrings=tuple(value))
        raise _type_error(path, value, allowed)


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
        section = _check_keys(path, section, cls.KEYS)
        out = {}
        for key in ("local_norm", "device_norm"):
            if key in section:
                out[key] = ParamFilter.parse(f"{path}.{key}", section[key])
        for key in ("local_loss", "device_loss"):
            if key in section:
                out[key] = _bool(f"{path}.{key}", section[key])
        return cls(**out)

    def to_dict(self) -> dict:
        return {"local_norm": self.local_norm.to_yaml(), "local_loss": self.local_loss,
                "device_norm": self.device_norm.to_yaml(), "device_loss": self.device_loss}


@dataclass(frozen=True)
class MoEMonitorConfig:
    """`monitor.moe_monitor`: tokens per expert."""

    save_tokens_per_expert_interval: Optional[int] = None
    target_layers: Union[None, int, Tuple[int, ...]] = None

    KEYS = ("save_tokens_per_expert_interval", "target_layers")

    @property
    def active(self) -> bool:
        return self.save_tokens_per_expert_interval is not None

    @classmethod
    def parse(cls, path: str, section: Any) -> "MoEMonitorConfig":
        section = _check_keys(path, section, cls.KEYS)
        interval = section.get("save_tokens_per_expert_interval")
        key = f"{path}.save_tokens_per_expert_interval"
        if interval is not None:
            if not _is_int(interval):
                raise _type_error(key, interval, "None (off) or a positive int")
            if interval <= 0:
                raise _value_error(key, interval, "None (off) or a positive int")
        layers = section.get("target_layers")
        key = f"{path}.target_layers"
        if isinstance(layers, (list, tuple)):
            if not all(_is_int(x) and x >= 0 for x in layers) or not layers:
                raise _value_error(key, layers, "a non-empty list of layer ids >= 0")
            repeated = sorted(x for x, n in Counter(layers).items() if n > 1)
            if repeated:
                raise _value_error(key, layers, f"distinct layer ids (listed more than once: {repeated[:10]}); "
                                                f"each layer would be counted once per listing")
            layers = tuple(layers)
        elif layers is not None and not _is_int(layers):
            raise _type_error(key, layers, "None (all MoE layers), an int N (layers 0..N-1) or a list of ints")
        elif _is_int(layers) and layers <= 0:
            raise _value_error(key, layers, "a positive int N (layers 0..N-1)")
        return cls(interval, layers)

    def to_dict(self) -> dict:
        layers = list(self.target_layers) if isinstance(self.target_layers, tuple) else self.target_layers
        return {"save_tokens_per_expert_interval": self.save_tokens_per_expert_interval, "target_layers": layers}


# Events tensorboardX may buffer; its queue is a semaphore that overflows at 2**31 - 1.
MAX_TENSORBOARD_QUEUE = 1_000_000


@dataclass(frozen=True)
class TensorBoardConfig:
    """`monitor.tensorboard`: MindFormers' own key, which its 1.9.0 PyNative Trainer accepts but
    never acts on; mindmon honours it. A non-empty `tensorboard_dir` switches the sink on, with
    event files in `<tensorboard_dir>/rank_<r>/`.

    Example:
        TensorBoardConfig.parse("monitor.tensorboard", {"tensorboard_dir": "./output/tensorboard"}).enabled  # True
    """

    tensorboard_dir: str = ""
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000

    KEYS = ("tensorboard_dir", "tensorboard_log_interval", "tensorboard_queue_size")

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard_dir)

    @classmethod
    def parse(cls, path: str, section: Any) -> "TensorBoardConfig":
        section = _check_keys(path, section, cls.KEYS)
        directory = section.get("tensorboard_dir", "")
        if directory:
            directory = _directory(f"{path}.tensorboard_dir", directory, 'a directory path, or "" (off)')
        elif directory not in (None, ""):
            raise _type_error(f"{path}.tensorboard_dir", directory, 'a directory path, or "" (off)')
        out = {"tensorboard_dir": directory or ""}
        for key, most in (("tensorboard_log_interval", None), ("tensorboard_queue_size", MAX_TENSORBOARD_QUEUE)):
            if key in section:
                value = section[key]
                allowed = "a positive int" + (f" up to {most}" if most else "")
                if not _is_int(value):
                    raise _type_error(f"{path}.{key}", value, allowed)
                if value <= 0 or (most and value > most):
                    raise _value_error(f"{path}.{key}", value, allowed)
                out[key] = value
        return cls(**out)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.KEYS}


# MindFormers' own monitor keys, handed to the stock config unchanged (1.9.0 accepts them);
# mindmon also reads `tensorboard` (TensorBoardConfig).
PASSTHROUGH_MONITOR_KEYS = ("health_checkpoint", "tensorboard")


@dataclass(frozen=True)
class MonitorConfig:
    """The `monitor` section: `train_state`, `moe_monitor`, where mindmon writes its files, which
    ranks collect (None = all) and the data-parallel group values are reduced over (None = world)."""

    train_state: TrainStateConfig = TrainStateConfig()
    moe_monitor: MoEMonitorConfig = MoEMonitorConfig()
    output_dir: str = DEFAULT_OUTPUT_DIR
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    ranks: Optional[Tuple[int, ...]] = None
    data_parallel_group: Optional[str] = None
    tensor_stats: Any = None   # mindmon.msprobe.config.TensorStatsConfig, or None when the key is absent
    alert: Any = None          # mindmon.alerts.config.AlertConfig, or None when the key is absent
    # mindmon.monitor_config.config.MonitorConfigSection: the top-level `monitor_config` section, or None
    monitor_config: Any = None
    metrics_formats: Tuple[str, ...] = ("jsonl",)   # rank_<r>/metrics.jsonl and/or rank_<r>/metrics.parquet

    KEYS = ("train_state", "moe_monitor", "output_dir", "ranks", "data_parallel_group", "tensor_stats", "alert",
            "metrics_formats")

    def selects_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    @property
    def active(self) -> bool:
        return (self.train_state.active or self.moe_monitor.active or self.collects_tensor_stats
                or (self.monitor_config is not None and self.monitor_config.active))

    @property
    def collects_tensor_stats(self) -> bool:
        return self.tensor_stats is not None and self.tensor_stats.active

    @property
    def alerts(self) -> bool:
        return self.alert is not None and self.alert.active

    @classmethod
    def parse(cls, section: Any, path: str = "monitor") -> "MonitorConfig":
        section = _check_keys(path, section, cls.KEYS + PASSTHROUGH_MONITOR_KEYS)
        output_dir = _directory(f"{path}.output_dir", section.get("output_dir", DEFAULT_OUTPUT_DIR),
                                "a non-empty directory path")
        group = section.get("data_parallel_group")
        if group is not None and (not isinstance(group, str) or not group):
            raise _type_error(f"{path}.data_parallel_group", group, "None (the world) or a communication group name")
        return cls(TrainStateConfig.parse(f"{path}.train_state", section.get("train_state")),
                   MoEMonitorConfig.parse(f"{path}.moe_monitor", section.get("moe_monitor")),
                   output_dir,
                   TensorBoardConfig.parse(f"{path}.tensorboard", section.get("tensorboard")),
                   parse_ranks(f"{path}.ranks", section.get("ranks")), group,
                   *_parse_engine_sections(section, path),
                   metrics_formats=parse_metrics_formats(f"{path}.metrics_formats",
                                                         section.get("metrics_formats", ["jsonl"])))

    def to_dict(self) -> dict:
        out = {"train_state": self.train_state.to_dict(), "moe_monitor": self.moe_monitor.to_dict(),
               "output_dir": self.output_dir, "tensorboard": self.tensorboard.to_dict(),
               "ranks": list(self.ranks) if self.ranks is not None else None,
               "data_parallel_group": self.data_parallel_group, "metrics_formats": list(self.metrics_formats)}
        if self.tensor_stats is not None:
            out["tensor_stats"] = {k: v for k, v in dataclasses.asdict(self.tensor_stats).items() if k != "later"}
        if self.alert is not None:
            out["alert"] = self.alert.to_dict()
        if self.monitor_config is not None:
            out["monitor_config"] = self.monitor_config.to_dict()
        return out


def _parse_engine_sections(section: dict, path: str) -> tuple:
    """`tensor_stats` (msprobe's config.json keys, or the path of such a file) and `alert`; their
    parsers live with their features and are imported only when the key is there."""
    tensor_stats = alert = None
    if section.get("tensor_stats") is not None:
        from .msprobe.config import parse_tensor_stats

        tensor_stats = parse_tensor_stats(section["tensor_stats"], f"{path}.tensor_stats")
    if section.get("alert") is not None:
        from .alerts.config import AlertConfig

        alert = AlertConfig.parse(f"{path}.alert", section["alert"])
    return tensor_stats, alert


METRICS_FORMATS = ("jsonl", "parquet")


def parse_metrics_formats(path: str, value: Any) -> Tuple[str, ...]:
    """A non-empty list of distinct METRICS_FORMATS (a single name is accepted too)."""
    formats = [value] if isinstance(value, str) else value
    allowed = f"a non-empty list of distinct names from {list(METRICS_FORMATS)}"
    if not isinstance(formats, (list, tuple)) or not formats or not all(isinstance(f, str) for f in formats):
        raise _type_error(path, value, allowed)
    if not set(formats) <= set(METRICS_FORMATS) or len(set(formats)) != len(formats):
        raise _value_error(path, value, allowed)
    return tuple(formats)


def parse_ranks(path: str, ranks: Any) -> Optional[Tuple[int, ...]]:
    """A rank selection: None = every rank, else a non-empty list of rank ids."""
    if ranks is None:
        return None
    if not isinstance(ranks, (list, tuple)) or not ranks or not all(_is_int(r) and r >= 0 for r in ranks):
        raise _value_error(path, ranks, "None (all ranks) or a non-empty list of rank ids >= 0")
    return tuple(ranks)


PROFILER_LEVELS = (0, 1, 2)


@dataclass(frozen=True)
class ProfilerConfig:
    """The `profiler` section. `profiler_level` outside 0/1/2 means LevelNone."""

    enable_profiling: bool = False
    start_step: int = 1
    end_step: int = 1
    output_path: Optional[str] = None
    profiler_rank: Optional[Tuple[int, ...]] = None
    profiler_level: int = 0
    mstx: bool = False
    profile_memory: bool = False
    profile_cpu: bool = True
    with_stack: bool = True

    KEYS = ("enable_profiling", "start_step", "end_step", "output_path", "profiler_rank", "profiler_level",
            "mstx", "profile_memory", "profile_cpu", "with_stack")

    @property
    def level_is_valid(self) -> bool:
        return self.profiler_level in PROFILER_LEVELS

    def selects_rank(self, rank: int) -> bool:
        return self.profiler_rank is None or rank in self.profiler_rank

    @classmethod
    def parse(cls, section: Any, path: str = "profiler") -> "ProfilerConfig":
        section = _check_keys(path, section, cls.KEYS)
        out = {k: _bool(f"{path}.{k}", section[k])
               for k in ("enable_profiling", "mstx", "profile_memory", "profile_cpu", "with_stack") if k in section}
        for key in ("start_step", "end_step", "profiler_level"):
            if key in section and not _is_int(section[key]):
                raise _type_error(f"{path}.{key}", section[key], "an int")
        for key in ("start_step", "end_step"):
            if key in section and section[key] <= 0:
                raise _value_error(f"{path}.{key}", section[key], "a positive int")
        if "start_step" in section and section["start_step"] != 1 and "end_step" not in section:
            raise ConfigError(f"{path}.end_step: missing while {path}.start_step is {section['start_step']}; "
                              f"allowed: an end_step >= start_step (the default end_step 1 would leave the window empty)")
        start, end = section.get("start_step", 1), section.get("end_step", 1)
        if end < start:
            raise ConfigError(f"{path}.end_step: got {end}, which is before {path}.start_step={start}; "
                              f"allowed: end_step >= start_step")
        out.update(start_step=start, end_step=end)
        if "profiler_level" in section:
            out["profiler_level"] = section["profiler_level"]
        output_path = section.get("output_path")
        if output_path is not None:
            output_path = _directory(f"{path}.output_path", output_path, "None or a non-empty directory path")
        out["output_path"] = output_path
        out["profiler_rank"] = parse_ranks(f"{path}.profiler_rank", section.get("profiler_rank"))
        return cls(**out)

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.KEYS}
        out["profiler_rank"] = list(self.profiler_rank) if self.profiler_rank is not None else None
        return out


def _parse_callbacks(value: Any, path: str = "callbacks") -> Tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise _type_error(path, value, "a list of mappings, each with a 'type' key")
    first_max_logits = None
    for index, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise _type_error(f"{path}[{index}]", item, "a mapping with a 'type' string")
        if item["type"] == "MaxLogitsMonitor":
            _check_keys(f"{path}[{index}]", item, ("type", "step_interval"))
            check_step_interval(item.get("step_interval", 1), f"{path}[{index}].step_interval")
            if first_max_logits is not None:
                # Each one resets the model's running max at step end: the second would read a reset max.
                raise ConfigError(f"{path}[{index}]: a second MaxLogitsMonitor (the first is {path}[{first_max_logits}]);"
                                  f" allowed: one MaxLogitsMonitor (set its step_interval)")
            first_max_logits = index
    return tuple(dict(item) for item in value)


def check_max_norm(value: Any, path: str = "training.max_norm") -> float:
    """The gradient-clipping norm: a finite number > 0 clips to it, 0 turns clipping off
    (MindFormers clips only when max_norm > 0). A negative value is refused rather than read as off."""
    allowed = "a finite number > 0 (clip the global gradient norm to it) or 0 (no clipping)"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _type_error(path, value, allowed)
    if not math.isfinite(value) or value < 0:
        raise _value_error(path, value, allowed)
    return float(value)


def check_step_interval(value: Any, path: str = "step_interval") -> int:
    """`MaxLogitsMonitor.step_interval`: a positive int, else ValueError (as upstream)."""
    if not _is_int(value) or value <= 0:
        raise _value_error(path, value, "a positive int")
    return value


@dataclass(frozen=True)
class MindmonConfig:
    """The three sections mindmon reads from a training YAML, and the optimizer's QK-clip switch
    (Muon with `qk_clip_enabled` needs the model's max-logit tracking, seed section 1.3)."""

    monitor: MonitorConfig = MonitorConfig()
    profiler: ProfilerConfig = ProfilerConfig()
    callbacks: Tuple[dict, ...] = ()
    optimizer_type: Optional[str] = None
    qk_clip_enabled: bool = False

    def to_dict(self) -> dict:
        return {"monitor": self.monitor.to_dict(), "profiler": self.profiler.to_dict(),
                "callbacks": [dict(c) for c in self.callbacks]}


def _parse_qk_clip(optimizer: Any) -> bool:
    if not isinstance(optimizer, dict) or "qk_clip_enabled" not in optimizer:
        return False
    return _bool("optimizer.qk_clip_enabled", optimizer["qk_clip_enabled"])


def parse_sections(raw: Dict[str, Any]) -> MindmonConfig:
    """Validate the mindmon sections of a whole training config (other sections are ignored)."""
    if not isinstance(raw, dict):
        raise _type_error("<config>", raw, "a mapping of sections")
    training = raw.get("training")
    if isinstance(training, dict) and "max_norm" in training:
        check_max_norm(training["max_norm"])
    optimizer = raw.get("optimizer")
    config = MindmonConfig(MonitorConfig.parse(raw.get("monitor")),
                           ProfilerConfig.parse(raw.get("profiler")),
                           _parse_callbacks(raw.get("callbacks")),
                           optimizer.get("type") if isinstance(optimizer, dict) else None,
                           _parse_qk_clip(optimizer))
    # MindFormers' graph-mode `monitor_config` (and `check_for_nan_in_loss_and_grad`), mapped onto the sections above.
    from .monitor_config.config import apply_monitor_config

    return apply_monitor_config(raw, config)


def load_yaml(path: str) -> Dict[str, Any]:
    """A training YAML as a plain dict, with omegaconf `${...}` interpolations resolved; a broken
    file is a `ConfigFileError` naming the file and line (see mindmon/yaml_file.py)."""
    from .yaml_file import load_yaml as load

    return load(path)


def describe_error(file: str, error: Exception) -> str:
    """`<file>: <message>` for a ConfigError or OSError about `file` (the file is named once)."""
    text = str(error) if not isinstance(error, OSError) else f"{error.strerror or error}"
    if getattr(error, "file", None) is not None or text.startswith(f"{file}:"):
        return text
    return f"{file}: {text}"


def rank_selection_warnings(config: MindmonConfig, world_size: int) -> List[str]:
    """What `monitor.ranks` and `profiler.profiler_rank` select that this run of `world_size` ranks
    does not have. Not an error: one YAML may serve runs of several sizes."""
    warnings = []
    selections = [("monitor.ranks", config.monitor.ranks)]
    if config.profiler.enable_profiling:
        selections.append(("profiler.profiler_rank", config.profiler.profiler_rank))
    for path, ranks in selections:
        missing = sorted({r for r in ranks or () if r >= world_size})
        if ranks is not None and len(missing) == len(set(ranks)):
            warnings.append(f"{path}: {list(ranks)} selects none of this run's ranks 0..{world_size - 1}; "
                            f"nothing is collected")
        elif missing:
            warnings.append(f"{path}: rank(s) {missing} do not exist in this run of {world_size} rank(s)")
    return warnings


def dump_sections(config: MindmonConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
