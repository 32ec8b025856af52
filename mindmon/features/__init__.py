"""The registry: every capability mindmon has, one line each. A capability is one folder here holding its
section's parser, its monitors, hooks, probes and sinks, and its registration (`FEATURE`, a
mindmon.core.engine.Feature). The factory builds every group from this list, in this order (its sinks are
written in this order too). Adding one: docs/architecture.md, "Adding a capability".
"""
from typing import List

from mindmon.config import MindmonConfig, parse_config
from mindmon.features import (across_ranks, alerts, loss_components, loss_scale, max_logits, moe_tokens,
                              monitor_config, profiler, speed, tensor_stats, trackers, train_state)

FEATURES = (
    train_state.FEATURE,
    loss_scale.FEATURE,
    moe_tokens.FEATURE,
    max_logits.FEATURE,
    tensor_stats.FEATURE,
    alerts.FEATURE,
    monitor_config.FEATURE,
    loss_components.FEATURE,   # after monitor_config: its TensorBoard tags wrap monitor_config's
    profiler.FEATURE,
    across_ranks.FEATURE,   # after train_state and moe_monitor: it reads their sections and monitor
    speed.FEATURE,
    trackers.FEATURE,   # last: closes after the files it sends
)


def parse_sections(raw: dict, features=FEATURES) -> MindmonConfig:
    """Validate the mindmon sections of a whole training config (other sections are ignored)."""
    return parse_config(raw, features)


def section_of(config: MindmonConfig, feature):
    """The feature's section in `config` (None when the feature has none)."""
    if feature.path is not None and feature.path.startswith("monitor."):
        return config.monitor.sections.get(feature.name)
    return config.sections.get(feature.name)


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
