"""Builds the monitors, sinks and trainer callbacks a validated config asks for: the one place that
knows which class serves which key.

Example (a plain loop; docs/plain-loop.md):
    config = parse_sections({"monitor": {"train_state": {"local_loss": True}},
                             "callbacks": [{"type": "MaxLogitsMonitor", "step_interval": 1}]})
    group = build_group(config, model=net, parameter_names=parameter_names(net, optimizer))
"""
import logging
import os
from typing import List, Optional, Sequence, Union

from .config import ConfigError, MindmonConfig, MonitorConfig
from .distributed import DataParallel
from .engine import Monitor, Sink
from .group import MonitorGroup

MAX_LOGITS_CALLBACK = "MaxLogitsMonitor"
TENSOR_STATS_FOLDER = "tensor_stats"   # msprobe's CSV run folders go under <output_dir>/tensor_stats/


class _RankTagged(logging.LoggerAdapter):
    """Python's logger does not say which process wrote a line; MindFormers' does (rank_<r>/ files)."""

    def process(self, msg, kwargs):
        tag = f"[rank {self.extra['rank']}] "
        return tag + str(msg).replace("\n", "\n" + tag), kwargs   # every line of a block says its rank


def default_logger(rank: int, several_ranks: bool):
    logger = logging.getLogger("mindmon")
    return _RankTagged(logger, {"rank": rank}) if several_ranks else logger


def max_logits_interval(config: MindmonConfig) -> Optional[int]:
    """The `step_interval` of the `MaxLogitsMonitor` entry of `callbacks:`, None when there is none."""
    entries = [c for c in config.callbacks if c.get("type") == MAX_LOGITS_CALLBACK]
    if len(entries) > 1:
        raise ConfigError(f"callbacks: {len(entries)} MaxLogitsMonitor entries; allowed: one (a second would "
                          f"read a running max the first has already reset)")
    return entries[0].get("step_interval", 1) if entries else None


def build_monitors(config: MonitorConfig, model, parameter_names: Sequence[str], rank: int, on_host: bool,
                   data_parallel: DataParallel, logger, max_logits_every: Optional[int]) -> List[Monitor]:
    from .monitors import MaxAttentionLogitMonitor, MoETokensMonitor, TrainStateMonitor

    monitors: List[Monitor] = []
    # Cross-rank values need every rank in the collective: only when all ranks collect.
    cross_rank = data_parallel.active and config.ranks is None
    if config.train_state.active:
        monitors.append(TrainStateMonitor(config.train_state, parameter_names, rank, on_host))
    if config.moe_monitor.active:
        if model is None:
            raise ConfigError("monitor.moe_monitor: save_tokens_per_expert_interval is set but no model was "
                              "given; pass model= so its MoE layers can be found")
        monitors.append(MoETokensMonitor(config.moe_monitor, model, rank, on_host, logger, cross_rank))
    if config.collects_tensor_stats and config.tensor_stats.selects_rank(rank):
        from .monitors.tensor_stats import TensorStatsMonitor

        monitors.append(TensorStatsMonitor(config.tensor_stats.ops, config.tensor_stats.eps, on_host, rank))
    if max_logits_every is not None and model is not None:
        monitors.append(MaxAttentionLogitMonitor(model, max_logits_every, rank,
                                                 data_parallel if cross_rank else None, logger))
    return monitors


def build_sinks(config: MonitorConfig, logger, rank: int = 0, data_parallel: Optional[DataParallel] = None):
    """(sinks, alert actions or None)."""
    from .sinks import LogSink, MegatronTokensPerExpertSink
    from .sinks.metrics import metrics_sinks, parallel_coordinates

    section = config.monitor_config if config.monitor_config is not None and config.monitor_config.active else None
    if section is not None:
        from .sinks.training_state import TrainingStateLogSink

        sinks: List[Sink] = [TrainingStateLogSink(logger, section)]
    else:
        sinks = [LogSink(logger)]
    sinks += metrics_sinks(config.metrics_formats, config.output_dir, parallel_coordinates(data_parallel))
    if config.tensorboard.enabled:
        from .sinks.tensorboard import TensorBoardSink, record_tags
        from .sinks.training_state import tensorboard_tags

        tensorboard = config.tensorboard
        sinks.append(TensorBoardSink(tensorboard.tensorboard_dir, tensorboard.tensorboard_log_interval,
                                     tensorboard.tensorboard_queue_size,
                                     tensorboard_tags(section, record_tags) if section is not None else record_tags))
    if config.moe_monitor.active:
        sinks.append(MegatronTokensPerExpertSink(config.output_dir))
    if config.collects_tensor_stats:
        from .sinks.csv import MsprobeCsvSink

        stats = config.tensor_stats
        sinks.append(MsprobeCsvSink(os.path.join(config.output_dir, TENSOR_STATS_FOLDER), stats.ndigits,
                                    stats.step_count_per_record, stats.significant_digits, stats.append_output))
    actions = None
    if config.alerts:
        from .alerts.sink import build_alert_sink

        alert_sink, actions = build_alert_sink(config.alert, config.output_dir, rank, logger, data_parallel)
        sinks.append(alert_sink)
    return sinks, actions


def build_group(config: Union[MindmonConfig, MonitorConfig], model=None, parameter_names: Sequence[str] = (),
                rank: Optional[int] = None, logger=None, on_host: Optional[bool] = None,
                data_parallel: Optional[DataParallel] = None, optimizer=None,
                global_batch_size: Optional[int] = None) -> MonitorGroup:
    """The MonitorGroup of one rank: the monitors the config switches on (none on a rank that
    `monitor.ranks` leaves out) and the sinks they write to. `optimizer` and `global_batch_size`
    serve monitor_config's optimizer state and throughput."""
    from .stats import host_is_device

    full = config if isinstance(config, MindmonConfig) else MindmonConfig(monitor=config)
    monitor = full.monitor
    data_parallel = data_parallel or DataParallel(monitor.data_parallel_group)
    rank = data_parallel.rank if rank is None else rank
    logger = logger or default_logger(rank, data_parallel.active)
    every = max_logits_interval(full)
    monitors = []
    if monitor.selects_rank(rank):
        on_host = host_is_device() if on_host is None and (monitor.active or every) else on_host
        monitors = build_monitors(monitor, model, parameter_names, rank, on_host, data_parallel, logger, every)
    sinks, actions = build_sinks(monitor, logger, rank, data_parallel)
    if monitor.monitor_config is not None and monitor.monitor_config.active:
        from .monitor_config.build import build_monitor_config

        extra, actions = build_monitor_config(monitor.monitor_config, model, optimizer, parameter_names, rank,
                                              on_host, data_parallel, global_batch_size, logger, actions,
                                              monitor.selects_rank(rank))
        monitors += extra
    return MonitorGroup(monitors, sinks, rank, logger, actions)


def build_callbacks(group: MonitorGroup, config: Union[MindmonConfig, MonitorConfig]) -> list:
    """The trainer callbacks: one that flushes the group at every step end (when it has monitors,
    or TensorBoard alone, which still gets the trainer's loss / lr / grad norm), and the profiler's
    when `enable_profiling` is on and this rank is in `profiler_rank`."""
    from .callbacks import MonitorCallback, ProfilerCallback

    full = config if isinstance(config, MindmonConfig) else MindmonConfig(monitor=config)
    callbacks = [MonitorCallback(group)] if group.active or full.monitor.tensorboard.enabled else []
    profiler = full.profiler
    if profiler.enable_profiling and profiler.selects_rank(group.rank):
        callbacks.append(ProfilerCallback(profiler, group.rank, group.logger))
    return callbacks
