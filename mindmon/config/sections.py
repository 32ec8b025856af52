"""The configuration's core: the `monitor` section's own keys (where files go, which ranks collect, the
data-parallel group, MindFormers' `monitor.tensorboard`), the `callbacks` list, and the sections of the
features, each parsed by the feature that owns it (mindmon.features lists them).

The core knows no feature: `parse_config(raw, features)` is handed the features, each with a `name`, a
`path` (where its section sits: "monitor.train_state", "profiler"; None for a feature that only
translates another dialect), a `parse(path, value)` that returns the section (None or an object with
`active`, from the value or None when the key is absent), and a `translate(raw, config)` (or None) that
maps a dialect (MindFormers' `monitor_config`) onto the parsed sections.

Example:
    from mindmon import parse_sections
    config = parse_sections({"monitor": {"train_state": {"local_norm": ["attention"], "local_loss": True}}})
    config.monitor.train_state.local_norm.matches("decoder.layers.0.self_attention.linear_qkv.weight")  # True
"""
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import yaml

from mindmon.config.checks import (check_bool, check_directory, check_keys, check_one_of, is_int,
                                   parse_ranks, type_error, value_error)

DEFAULT_OUTPUT_DIR = "./output/monitor"
# MindFormers' own monitor keys, handed to the stock config unchanged (1.9.0 accepts them);
# mindmon also reads `tensorboard` (TensorBoardConfig).
PASSTHROUGH_MONITOR_KEYS = ("health_checkpoint", "tensorboard")
MONITOR_KEYS = ("output_dir", "ranks", "data_parallel_group", "metrics_formats", "tensorboard_tags")
METRICS_FORMATS = ("jsonl", "parquet")


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
        section = check_keys(path, section, cls.KEYS)
        directory = section.get("tensorboard_dir", "")
        if directory:
            directory = check_directory(f"{path}.tensorboard_dir", directory, 'a directory path, or "" (off)')
        elif directory not in (None, ""):
            raise type_error(f"{path}.tensorboard_dir", directory, 'a directory path, or "" (off)')
        out = {"tensorboard_dir": directory or ""}
        for key, most in (("tensorboard_log_interval", None), ("tensorboard_queue_size", MAX_TENSORBOARD_QUEUE)):
            if key in section:
                value = section[key]
                allowed = "a positive int" + (f" up to {most}" if most else "")
                if not is_int(value):
                    raise type_error(f"{path}.{key}", value, allowed)
                if value <= 0 or (most and value > most):
                    raise value_error(f"{path}.{key}", value, allowed)
                out[key] = value
        return cls(**out)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.KEYS}


TENSORBOARD_DETAILS = ("layer", "parameter")


@dataclass(frozen=True)
class TensorBoardTagsConfig:
    """`monitor.tensorboard_tags`: which tags the TensorBoard sink writes. mindmon's own key, next to
    `monitor.tensorboard` rather than in it: MindFormers gets `monitor.tensorboard` as it is, and refuses a
    key it does not know there.

    `detail: layer` (the default) writes the per-parameter gradient norms (`local_norm`, `micro_norm`,
    `device_norm`) one curve per layer (mindmon.sinks.tensorboard.layer_of) and leaves out rank 0's
    per-parameter cross-rank columns; `parameter` writes one curve per parameter and every column.
    `vs_samples: true` adds each tag's `<tag>_vs_samples` copy against the samples consumed.

    Example:
        TensorBoardTagsConfig.parse("monitor.tensorboard_tags", {"detail": "parameter"}).vs_samples   # False
    """

    detail: str = "layer"
    vs_samples: bool = False

    KEYS = ("detail", "vs_samples")

    @classmethod
    def parse(cls, path: str, section: Any) -> "TensorBoardTagsConfig":
        section = check_keys(path, section, cls.KEYS)
        out = {}
        if "detail" in section:
            out["detail"] = check_one_of(f"{path}.detail", section["detail"], TENSORBOARD_DETAILS)
        if "vs_samples" in section:
            out["vs_samples"] = check_bool(f"{path}.vs_samples", section["vs_samples"])
        return cls(**out)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.KEYS}


class _Sections:
    """A feature's section read as an attribute, as the YAML spells it: `config.monitor.train_state`."""

    def __getattr__(self, name: str):
        sections = self.__dict__.get("sections") or {}
        if name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__} has no section {name!r} (sections: {sorted(sections)})")

    def section_dicts(self) -> dict:
        """Each section as the YAML would spell it; absent ones, and those read from another key (a
        callback's entry in `callbacks:`), are left out."""
        out = {name: s.to_dict() for name, s in self.sections.items() if s is not None}
        return {name: d for name, d in out.items() if d is not None}


@dataclass(frozen=True)
class MonitorConfig(_Sections):
    """The `monitor` section: where mindmon writes its files, which ranks collect (None = all), the
    data-parallel group values are reduced over (None = world), TensorBoard, and the features' sections
    under `monitor:` (`train_state`, `moe_monitor`, `tensor_stats`, `alert`), by key."""

    output_dir: str = DEFAULT_OUTPUT_DIR
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    ranks: Optional[Tuple[int, ...]] = None
    data_parallel_group: Optional[str] = None
    sections: Mapping[str, Any] = field(default_factory=dict)
    metrics_formats: Tuple[str, ...] = ("jsonl",)   # rank_<r>/metrics.jsonl and/or rank_<r>/metrics.parquet
    tensorboard_tags: TensorBoardTagsConfig = TensorBoardTagsConfig()

    def selects_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    @property
    def active(self) -> bool:
        """Does any feature under `monitor:` collect?"""
        return any(s is not None and s.active for s in self.sections.values())

    @classmethod
    def parse(cls, section: Any, features: Sequence[Any], path: str = "monitor") -> "MonitorConfig":
        own = [f for f in features if f.path and f.path.startswith(path + ".")]
        keys = {f.path[len(path) + 1:]: f for f in own}
        section = check_keys(path, section, MONITOR_KEYS + tuple(keys) + PASSTHROUGH_MONITOR_KEYS)
        output_dir = check_directory(f"{path}.output_dir", section.get("output_dir", DEFAULT_OUTPUT_DIR),
                                     "a non-empty directory path")
        group = section.get("data_parallel_group")
        if group is not None and (not isinstance(group, str) or not group):
            raise type_error(f"{path}.data_parallel_group", group, "None (the world) or a communication group name")
        tensorboard = TensorBoardConfig.parse(f"{path}.tensorboard", section.get("tensorboard"))
        ranks = parse_ranks(f"{path}.ranks", section.get("ranks"))
        sections = {f.name: f.parse(f.path, section.get(key)) for key, f in keys.items()}
        formats = parse_metrics_formats(f"{path}.metrics_formats", section.get("metrics_formats", ["jsonl"]))
        tags = TensorBoardTagsConfig.parse(f"{path}.tensorboard_tags", section.get("tensorboard_tags"))
        return cls(output_dir, tensorboard, ranks, group, sections, formats, tags)

    def to_dict(self) -> dict:
        return {"output_dir": self.output_dir, "tensorboard": self.tensorboard.to_dict(),
                "tensorboard_tags": self.tensorboard_tags.to_dict(),
                "ranks": list(self.ranks) if self.ranks is not None else None,
                "data_parallel_group": self.data_parallel_group, "metrics_formats": list(self.metrics_formats),
                **self.section_dicts()}


@dataclass(frozen=True)
class MindmonConfig(_Sections):
    """What mindmon reads from a training YAML: `monitor`, `callbacks`, the top-level sections of the
    features (`profiler`, `monitor_config`) by name, and the optimizer's QK-clip switch (Muon with
    `qk_clip_enabled` needs the model's max-logit tracking)."""

    monitor: MonitorConfig = MonitorConfig()
    callbacks: Tuple[dict, ...] = ()
    optimizer_type: Optional[str] = None
    qk_clip_enabled: bool = False
    sections: Mapping[str, Any] = field(default_factory=dict)

    def with_section(self, name: str, section: Any) -> "MindmonConfig":
        """This config with one section replaced: under `monitor:` when it is there, else top-level."""
        if name in self.monitor.sections:
            monitor = dataclasses.replace(self.monitor, sections={**self.monitor.sections, name: section})
            return dataclasses.replace(self, monitor=monitor)
        return dataclasses.replace(self, sections={**self.sections, name: section})

    def to_dict(self) -> dict:
        return {"monitor": self.monitor.to_dict(), **self.section_dicts(),
                "callbacks": [dict(c) for c in self.callbacks]}


@dataclass(frozen=True)
class OnOffSection:
    """A feature's section that only switches it on: `{enabled: true}` (subclasses document the feature)."""

    enabled: bool = False

    KEYS = ("enabled",)

    @property
    def active(self) -> bool:
        return self.enabled

    @classmethod
    def parse(cls, path: str, section: Any) -> "OnOffSection":
        section = check_keys(path, section, cls.KEYS)
        return cls(check_bool(f"{path}.enabled", section.get("enabled", False)))

    def to_dict(self) -> dict:
        return {"enabled": self.enabled}


def parse_metrics_formats(path: str, value: Any) -> Tuple[str, ...]:
    """A non-empty list of distinct METRICS_FORMATS (a single name is accepted too)."""
    formats = [value] if isinstance(value, str) else value
    allowed = f"a non-empty list of distinct names from {list(METRICS_FORMATS)}"
    if not isinstance(formats, (list, tuple)) or not formats or not all(isinstance(f, str) for f in formats):
        raise type_error(path, value, allowed)
    if not set(formats) <= set(METRICS_FORMATS) or len(set(formats)) != len(formats):
        raise value_error(path, value, allowed)
    return tuple(formats)


def parse_callbacks(value: Any, path: str = "callbacks") -> Tuple[dict, ...]:
    """The trainer callbacks to build: a list of mappings, each with a `type` string (its other keys are
    the callback's own; a feature that owns a callback type checks them)."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise type_error(path, value, "a list of mappings, each with a 'type' key")
    for index, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise type_error(f"{path}[{index}]", item, "a mapping with a 'type' string")
    return tuple(dict(item) for item in value)


def check_max_norm(value: Any, path: str = "training.max_norm") -> float:
    """The gradient-clipping norm: a finite number > 0 clips to it, 0 turns clipping off
    (MindFormers clips only when max_norm > 0). A negative value is refused rather than read as off."""
    allowed = "a finite number > 0 (clip the global gradient norm to it) or 0 (no clipping)"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise type_error(path, value, allowed)
    if not math.isfinite(value) or value < 0:
        raise value_error(path, value, allowed)
    return float(value)


def _parse_qk_clip(optimizer: Any) -> bool:
    if not isinstance(optimizer, dict) or "qk_clip_enabled" not in optimizer:
        return False
    return check_bool("optimizer.qk_clip_enabled", optimizer["qk_clip_enabled"])


def parse_config(raw: Dict[str, Any], features: Sequence[Any]) -> MindmonConfig:
    """Validate the mindmon sections of a whole training config (other sections are ignored)."""
    if not isinstance(raw, dict):
        raise type_error("<config>", raw, "a mapping of sections")
    training = raw.get("training")
    if isinstance(training, dict) and "max_norm" in training:
        check_max_norm(training["max_norm"])
    optimizer = raw.get("optimizer")
    monitor = MonitorConfig.parse(raw.get("monitor"), features)
    callbacks = parse_callbacks(raw.get("callbacks"))
    top = {f.name: f.parse(f.path, callbacks if f.path == "callbacks" else raw.get(f.path))
           for f in features if f.path and "." not in f.path}
    config = MindmonConfig(monitor, callbacks, optimizer.get("type") if isinstance(optimizer, dict) else None,
                           _parse_qk_clip(optimizer), top)
    for feature in features:
        if feature.translate is not None:
            config = feature.translate(raw, config)
    return config


def dump_sections(config: MindmonConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
