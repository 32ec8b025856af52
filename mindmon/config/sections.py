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

from mindmon.config.checks import check_bool, check_directory, check_keys, type_error, value_error
from mindmon.config.fields import (Section, boolean, custom, directory, integer, keys_of, nested, one_of,
                                   parse_settings, ranks, section_dict, setting)

DEFAULT_OUTPUT_DIR = "./output/monitor"
# MindFormers' own monitor keys, handed to the stock config unchanged (1.9.0 accepts them);
# mindmon also reads `tensorboard` (TensorBoardConfig).
PASSTHROUGH_MONITOR_KEYS = ("health_checkpoint", "tensorboard")
METRICS_FORMATS = ("jsonl", "parquet")


# Events tensorboardX may buffer; its queue is a semaphore that overflows at 2**31 - 1.
MAX_TENSORBOARD_QUEUE = 1_000_000


def _tensorboard_dir(path: str, value: Any) -> str:
    allowed = 'a directory path, or "" (off)'
    if value:
        return check_directory(path, value, allowed)
    if value not in (None, ""):
        raise type_error(path, value, allowed)
    return ""


@dataclass(frozen=True)
class TensorBoardConfig(Section):
    """`monitor.tensorboard`: MindFormers' own key, which its 1.9.0 PyNative Trainer accepts but
    never acts on; mindmon honours it. A non-empty `tensorboard_dir` switches the sink on, with
    event files in `<tensorboard_dir>/rank_<r>/`.

    Example:
        TensorBoardConfig.parse("monitor.tensorboard", {"tensorboard_dir": "./output/tensorboard"}).enabled  # True
    """

    tensorboard_dir: str = setting("", custom("str", _tensorboard_dir), shown_default='`""` (off)')
    """Non-empty = on; events go to `<tensorboard_dir>/rank_<r>/`."""

    tensorboard_log_interval: int = setting(1, integer(1, None, "a positive int", kind="positive int"))
    """Write the steps that are multiples of N (the JSONL keeps every step)."""

    tensorboard_queue_size: int = setting(1000, integer(1, MAX_TENSORBOARD_QUEUE,
                                                        f"a positive int up to {MAX_TENSORBOARD_QUEUE}"))
    """Events held in memory before they are written; a step's events are written at its end in one write
    anyway (a step with more is written in parts, and a failed write still cuts the file back to the last
    whole step)."""

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard_dir)


TENSORBOARD_DETAILS = ("layer", "parameter")


@dataclass(frozen=True)
class TensorBoardTagsConfig(Section):
    """`monitor.tensorboard_tags`: which tags the TensorBoard sink writes. mindmon's own key, next to
    `monitor.tensorboard` rather than in it: MindFormers gets `monitor.tensorboard` as it is, and refuses a
    key it does not know there.

    Example:
        TensorBoardTagsConfig.parse("monitor.tensorboard_tags", {"detail": "parameter"}).vs_samples   # False
    """

    detail: str = setting("layer", one_of(TENSORBOARD_DETAILS))
    """`layer`: `local_norm`, `micro_norm`, `device_norm` one curve per layer (a parameter's layer: its name
    up to and including the first numeric component, `decoder.layers.3`; a parameter outside numbered layers
    is its own group), and no per-parameter `across_ranks` columns; `parameter`: a curve per parameter and
    every column."""

    vs_samples: bool = setting(False, boolean())
    """Every tag also as `<tag>_vs_samples`, against the samples consumed (Megatron's `<tag> vs samples`)."""


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


def _data_parallel_group(path: str, value: Any) -> Optional[str]:
    if value is not None and (not isinstance(value, str) or not value):
        raise type_error(path, value, "None (the world) or a communication group name")
    return value


@dataclass(frozen=True)
class MonitorConfig(_Sections):
    """The `monitor` section: where mindmon writes its files, which ranks collect (None = all), the
    data-parallel group values are reduced over (None = world), TensorBoard, and the features' sections
    under `monitor:` (`train_state`, `moe_monitor`, `tensor_stats`, `alert`), by key."""

    output_dir: str = setting(DEFAULT_OUTPUT_DIR, directory("a non-empty directory path"))
    """Where `rank_<r>/metrics.jsonl` goes (relative to the working directory)."""

    tensorboard: TensorBoardConfig = setting(TensorBoardConfig(), nested(TensorBoardConfig), shown_default="off")
    """MindFormers' own key, honoured by mindmon: see `monitor.tensorboard` (also passed to MindFormers
    unchanged)."""

    ranks: Optional[Tuple[int, ...]] = setting(None, ranks(), shown_default="`None` (all)")
    """Which ranks collect `train_state` and `moe_monitor` (msprobe's `module_ranks`); other ranks build no
    monitor."""

    data_parallel_group: Optional[str] = setting(None, custom("str or None", _data_parallel_group),
                                                 shown_default="`None` (the world)")
    """Communication group for the gradient mean and the cross-rank values (on Ascend: your data-parallel
    group); a name MindSpore does not know is a `ConfigError` once communication is initialised."""

    sections: Mapping[str, Any] = field(default_factory=dict)

    metrics_formats: Tuple[str, ...] = setting(("jsonl",), custom(
        f"list of {', '.join(f'`{f}`' for f in METRICS_FORMATS)} (or one name)", lambda p, v: parse_metrics_formats(p, v)))
    """The per-rank record files: `rank_<r>/metrics.jsonl` and/or `rank_<r>/metrics.parquet` (docs/outputs.md,
    "Columnar"); `parquet` needs `pip install 'mindmon[analysis]'` (without it, a `ConfigError` naming this
    key before step 1)."""

    tensorboard_tags: TensorBoardTagsConfig = setting(TensorBoardTagsConfig(), nested(TensorBoardTagsConfig),
                                                      shown_default="`{detail: layer, vs_samples: false}`")
    """Which TensorBoard tags mindmon writes: see `monitor.tensorboard_tags`."""

    def selects_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    @property
    def active(self) -> bool:
        """Does any feature under `monitor:` collect?"""
        return any(s is not None and s.active for s in self.sections.values())

    @classmethod
    def parse(cls, path: str, raw: Any, features: Sequence[Any] = ()) -> "MonitorConfig":
        """Its own keys, MindFormers' passed-through ones, and the section of each feature under `path`."""
        own = [f for f in features if f.path and f.path.startswith(path + ".")]
        keys = {f.path[len(path) + 1:]: f for f in own}
        own_keys = tuple(k for k in keys_of(cls) if k not in PASSTHROUGH_MONITOR_KEYS)
        section = check_keys(path, raw, own_keys + tuple(keys) + PASSTHROUGH_MONITOR_KEYS)
        sections = {f.name: f.parse(f.path, section.get(key)) for key, f in keys.items()}
        return cls(**parse_settings(cls, path, section), sections=sections)

    def to_dict(self) -> dict:
        own = section_dict(self)
        first = {key: own.pop(key) for key in ("output_dir", "tensorboard", "tensorboard_tags")}  # the two together
        return {**first, **own, **self.section_dicts()}


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
class OnOffSection(Section):
    """A feature's section that only switches it on: `{enabled: true}` (subclasses document the feature
    in their own `enabled` docstring)."""

    enabled: bool = setting(False, boolean())
    """Switches the feature on."""

    @property
    def active(self) -> bool:
        return self.enabled


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
    monitor = MonitorConfig.parse("monitor", raw.get("monitor"), features)
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
