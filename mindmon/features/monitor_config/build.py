"""The monitors, actions and outputs monitor_config adds to a rank's group (the factory calls this; the
train-state and max-logit parts of the section were mapped onto monitor.train_state and callbacks
when the config was parsed)."""
from typing import List

from mindmon.core.engine import Monitor


def _statistics(section, model, optimizer, rank: int, on_host: bool, data_parallel, global_batch_size,
                logger, layout=None) -> List[Monitor]:
    from mindmon.features.monitor_config.monitors import (OptimizerStateMonitor, StableRankMonitor,
                                                          ThroughputMonitor, WeightStateMonitor)

    monitors: List[Monitor] = []
    interval = section.step_interval
    if section.format("optimizer_state") and optimizer is not None:
        monitors.append(OptimizerStateMonitor(optimizer, section.selects, interval, rank, on_host, logger, layout))
    if section.format("weight_state") and model is not None:
        monitors.append(WeightStateMonitor(model, interval, rank, on_host, layout))
    if section.monitor_on and section.stable_rank.formats and model is not None:
        monitors.append(StableRankMonitor(model, section.stable_rank, rank, logger))
    if section.monitor_on and section.throughput_baseline is not None:
        ranks = data_parallel.size if data_parallel is not None else 1
        monitors.append(ThroughputMonitor(section.throughput_baseline, global_batch_size, ranks, interval, rank))
    return monitors


def build(build, section) -> None:
    """monitor_config's statistics on the ranks `monitor.ranks` selects; its step guard on every rank, so
    that every rank skips and stops at the same steps; its log lines and TensorBoard tags."""
    if not section.active:
        return
    from mindmon.features.monitor_config.guard import StepGuard
    from mindmon.features.monitor_config.sink import TrainingStateLogSink, tensorboard_tags

    build.log_sink = TrainingStateLogSink(build.logger, section)
    build.tensorboard_tags = lambda default: tensorboard_tags(section, default)
    if section.tensorboard_fallback:
        build.logger.warning("mindmon: monitor_config: no TensorBoard directory is configured (tensorboard."
                             "tensorboard_dir or monitor.tensorboard.tensorboard_dir); %s write to the log instead",
                             ", ".join(section.tensorboard_fallback))
    if build.collects:
        for monitor in _statistics(section, build.model, build.optimizer, build.rank, build.on_host,
                                   build.data_parallel, build.global_batch_size, build.logger, build.layout):
            build.add_monitor(monitor)
    if section.checks_spikes or section.check_for_nan_in_loss_and_grad or (section.monitor_on and section.print_struct):
        guard = StepGuard(section, build.parameter_names, build.rank, build.logger)
        build.add_monitor(guard)
        build.add_actions(guard)
