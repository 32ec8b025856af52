"""The monitors and actions monitor_config adds to a rank's group (the factory calls this; the
train-state and max-logit parts of the section were mapped onto monitor.train_state and callbacks
when the config was parsed)."""
from typing import List, Optional, Sequence, Tuple

from ..engine import Monitor
from .guard import CombinedActions, StepGuard
from .monitors import OptimizerStateMonitor, StableRankMonitor, ThroughputMonitor, WeightStateMonitor


def _statistics(section, model, optimizer, rank: int, on_host: bool, data_parallel, global_batch_size,
                logger) -> List[Monitor]:
    monitors: List[Monitor] = []
    interval = section.step_interval
    if section.format("optimizer_state") and optimizer is not None:
        monitors.append(OptimizerStateMonitor(optimizer, section.selects, interval, rank, on_host, logger))
    if section.format("weight_state") and model is not None:
        monitors.append(WeightStateMonitor(model, interval, rank, on_host))
    if section.monitor_on and section.stable_rank.formats and model is not None:
        monitors.append(StableRankMonitor(model, section.stable_rank, rank, logger))
    if section.monitor_on and section.throughput_baseline is not None:
        ranks = data_parallel.size if data_parallel is not None else 1
        monitors.append(ThroughputMonitor(section.throughput_baseline, global_batch_size, ranks, interval, rank))
    return monitors


def build_monitor_config(section, model, optimizer, parameter_names: Sequence[str], rank: int,
                         on_host: Optional[bool], data_parallel, global_batch_size: Optional[int], logger,
                         actions, collects: bool = True) -> Tuple[List[Monitor], object]:
    """(monitors, the group's actions). The statistics are collected on the ranks `monitor.ranks`
    selects (`collects`); the step guard is on every rank, so that every rank skips and stops at the
    same steps."""
    from ..stats import host_is_device

    if section.tensorboard_fallback:
        logger.warning("mindmon: monitor_config: no TensorBoard directory is configured (tensorboard.tensorboard_dir"
                       " or monitor.tensorboard.tensorboard_dir); %s write to the log instead",
                       ", ".join(section.tensorboard_fallback))
    monitors: List[Monitor] = []
    if collects:
        on_host = host_is_device() if on_host is None else on_host
        monitors = _statistics(section, model, optimizer, rank, on_host, data_parallel, global_batch_size, logger)
    if section.checks_spikes or section.check_for_nan_in_loss_and_grad or (section.monitor_on and section.print_struct):
        guard = StepGuard(section, parameter_names, rank, logger)
        monitors.append(guard)
        actions = CombinedActions([actions, guard]) if actions is not None else guard
    return monitors, actions
