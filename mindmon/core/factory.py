"""Builds one rank's MonitorGroup from a validated config: the run's own outputs (log lines, JSONL,
TensorBoard), then every registered feature's parts (mindmon/features/__init__.py), in registry order.
The one place that builds monitors and sinks.

Example (a plain loop; docs/plain-loop.md):
    config = parse_sections({"monitor": {"train_state": {"local_loss": True}},
                             "callbacks": [{"type": "MaxLogitsMonitor", "step_interval": 1}]})
    group = build_group(config, model=net, parameter_names=parameter_names(net, optimizer))
"""
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from mindmon.config import MindmonConfig
from mindmon.parallel.data_parallel import DataParallel
from mindmon.core.engine import CombinedActions, Feature, Monitor, Service, Sink
from mindmon.features import FEATURES, section_of
from mindmon.core.group import MonitorGroup


class _RankTagged(logging.LoggerAdapter):
    """Python's logger does not say which process wrote a line; MindFormers' does (rank_<r>/ files)."""

    def process(self, msg, kwargs):
        tag = f"[rank {self.extra['rank']}] "
        return tag + str(msg).replace("\n", "\n" + tag), kwargs   # every line of a block says its rank


def default_logger(rank: int, several_ranks: bool):
    logger = logging.getLogger("mindmon")
    return _RankTagged(logger, {"rank": rank}) if several_ranks else logger


@dataclass
class Build:
    """One rank's group in the making: what a feature's `build(build, section)` reads, and what it adds
    (`add_monitor`, `sinks`, `add_actions`, `parts` for a front door to pick up by feature name)."""

    config: MindmonConfig
    model: Any
    parameter_names: Sequence[str]
    rank: int
    logger: Any
    data_parallel: DataParallel
    optimizer: Any = None
    global_batch_size: Optional[int] = None
    own_outputs: bool = True        # False: a front door hands in its outputs instead of the run's
    given_on_host: Optional[bool] = None
    monitors: List[Monitor] = field(default_factory=list)
    sinks: List[Sink] = field(default_factory=list)
    services: List[Service] = field(default_factory=list)   # run beside training (the peer watchdog)
    actions: List[Any] = field(default_factory=list)  # asked before the update and after the step (alerts, guards)
    parts: Dict[str, Any] = field(default_factory=dict)
    log_sink: Any = None            # a feature's own log-line sink in place of the default one
    tensorboard_tags: Any = None    # a feature's own TensorBoard tags in place of the default ones
    layout: Any = None              # mindmon.parallel.ParallelLayout: the rank's place under model parallelism

    @property
    def collects(self) -> bool:
        """`monitor.ranks` selects this rank (sinks and step guards are built on every rank)."""
        return self.config.monitor.selects_rank(self.rank)

    @property
    def cross_rank(self) -> bool:
        """Cross-rank values need every rank in the collective: only when all ranks collect."""
        return self.data_parallel.active and self.config.monitor.ranks is None

    @property
    def on_host(self) -> bool:
        if self.given_on_host is None:
            from mindmon.kernels.stats import host_is_device

            self.given_on_host = host_is_device()
        return self.given_on_host

    def add_monitor(self, monitor: Monitor) -> None:
        self.monitors.append(monitor)

    def add_actions(self, actions) -> None:
        self.actions.append(actions)


def _own_outputs(build: Build) -> List[Sink]:
    from mindmon.sinks import LogSink
    from mindmon.sinks.metrics import metrics_sinks, parallel_coordinates

    monitor = build.config.monitor
    sinks = [build.log_sink or LogSink(build.logger)]
    sinks += metrics_sinks(monitor.metrics_formats, monitor.output_dir, parallel_coordinates(build.data_parallel,
                                                                                             build.layout), build.layout)
    if monitor.tensorboard.enabled:
        from mindmon.sinks.tensorboard import TensorBoardSink, record_tags

        tensorboard, shown = monitor.tensorboard, monitor.tensorboard_tags
        # MindFormers' TrainingStateMonitor tags (monitor_config) name parameters: they stay per parameter.
        mindformers_tags = getattr(build.config.sections.get("monitor_config"), "active", False)
        sinks.append(TensorBoardSink(tensorboard.tensorboard_dir, tensorboard.tensorboard_log_interval,
                                     tensorboard.tensorboard_queue_size,
                                     build.tensorboard_tags(record_tags) if build.tensorboard_tags else record_tags,
                                     detail="parameter" if mindformers_tags else shown.detail,
                                     vs_samples=shown.vs_samples))
    return sinks


def build(config: MindmonConfig, model=None, parameter_names: Sequence[str] = (), rank: Optional[int] = None,
          logger=None, on_host: Optional[bool] = None, data_parallel: Optional[DataParallel] = None,
          optimizer=None, global_batch_size: Optional[int] = None, outputs: Optional[Sequence[Sink]] = None,
          features: Sequence[Feature] = FEATURES, layout=None) -> Build:
    """Every feature's parts for one rank. `outputs`: the sinks a front door writes to instead of the
    run's log lines, JSONL and TensorBoard (msprobe's CSV, kj600's TensorBoard). `layout`
    (mindmon.parallel): the rank's place under model parallelism; give the same one to
    `AccumulatingTrainStep`."""
    if layout is not None:
        from mindmon.parallel.layout import check_collecting_ranks

        check_collecting_ranks(layout, config.monitor.ranks)
        data_parallel = data_parallel or layout.data_parallel
        rank = layout.rank if rank is None else rank
    data_parallel = data_parallel or DataParallel(config.monitor.data_parallel_group)
    rank = data_parallel.rank if rank is None else rank
    several = data_parallel.active or (layout is not None and layout.model_parallel)
    result = Build(config, model, parameter_names, rank, logger or default_logger(rank, several),
                   data_parallel, optimizer, global_batch_size, outputs is None, on_host, layout=layout)
    feature_sinks: List[Sink] = []
    for feature in features:
        section = section_of(config, feature)
        if feature.build is not None and section is not None:   # None: absent from this config
            result.sinks = []
            feature.build(result, section)
            feature_sinks += result.sinks
    result.sinks = (_own_outputs(result) if outputs is None else list(outputs)) + feature_sinks
    result.services += _peer_watchdog(result)
    return result


def _peer_watchdog(built: Build) -> List[Service]:
    """On a run of several ranks, the thread that names the ranks lost mid-run and, on rank 0, declares a hang
    (mindmon.parallel.watchdog): `monitor.speed.hang_after` when set, the ranks' stacks in the run's folder.
    What it finds goes, from its own thread (the training thread may be the one stuck), to the JSONL at once
    and to the alert recipients."""
    from mindmon.parallel.watchdog import peer_watchdog

    speed = built.config.monitor.sections.get("speed")
    watchdog = peer_watchdog(built.logger, speed.hang_after if speed is not None else None,
                             built.config.monitor.output_dir, lambda hang: _report_hang(built, hang),
                             lambda lost, line: _report_lost(built, lost, line))
    return [watchdog] if watchdog is not None else []


def _write_now(built: Build, records) -> None:
    from mindmon.sinks.jsonl import JsonlSink

    for sink in built.sinks:
        if isinstance(sink, JsonlSink):
            sink.write_now(records)


def _report_hang(built: Build, hang) -> None:
    from mindmon.core.records import HANG, Record

    odd = ", ".join(f"rank {r} in {hang.places[r].phase} of step {hang.places[r].step}" for r in hang.odd)
    name = odd or f"all ranks in {hang.majority[1]} of step {hang.majority[0]}"
    _write_now(built, [Record(hang.step, None, built.rank, HANG, name, float(hang.stalled))])
    alert = built.parts.get("alert")
    if alert is not None:
        alert.hang(hang)


def _report_lost(built: Build, lost, line: str) -> None:
    from mindmon.core.progress import PROGRESS
    from mindmon.core.records import RANK_LOST, Record

    step = PROGRESS.place.step
    _write_now(built, [Record(step, None, built.rank, RANK_LOST, f"rank {r}", 1.0) for r in lost])
    alert = built.parts.get("alert")
    if alert is not None:
        alert.rank_lost(lost, line, step=step)


def build_group(config: MindmonConfig, model=None, parameter_names: Sequence[str] = (), rank: Optional[int] = None,
                logger=None, on_host: Optional[bool] = None, data_parallel: Optional[DataParallel] = None,
                optimizer=None, global_batch_size: Optional[int] = None, layout=None) -> MonitorGroup:
    """The MonitorGroup of one rank: the monitors the config switches on (none on a rank that
    `monitor.ranks` leaves out) and the sinks they write to. `optimizer` and `global_batch_size`
    serve monitor_config's optimizer state and throughput; `layout` as for `build`."""
    return assemble(config, model, optimizer, parameter_names, rank, logger, on_host, data_parallel, global_batch_size,
                    layout=layout).group


@dataclass
class Run:
    """One rank's monitoring, assembled: what every front door gets from `assemble` and only wires into
    its own loop. `group` takes the step's events and writes the records; `callbacks` are the trainer
    callbacks (MindFormers' `TrainerCallback` protocol) the run needs; `parts` the pieces a front door
    attaches itself, by feature name (`tensor_stats`: a factory of the statistics' hooks)."""

    config: MindmonConfig
    group: MonitorGroup
    callbacks: List[Any]
    parts: Dict[str, Any]

    def tensor_stats_hooks(self, **given):
        """The tensor statistics' hooks recording into this run's group, or None when the config does not
        switch them on (or this rank does not collect). `given`: the front door's own arguments."""
        make = self.parts.get("tensor_stats")
        return None if make is None else make(**{"recorder": self.group, **given})


def assemble(config: MindmonConfig, model=None, optimizer=None, parameter_names: Optional[Sequence[str]] = None,
             rank: Optional[int] = None, logger=None, on_host: Optional[bool] = None,
             data_parallel: Optional[DataParallel] = None, global_batch_size: Optional[int] = None,
             outputs: Optional[Sequence[Sink]] = None, layout=None, features: Sequence[Feature] = FEATURES) -> Run:
    """The one assembly every front door calls (the MindFormers Trainer, a plain loop, msprobe's and kj600's
    TrainerMon): every registered feature's parts for this rank (`build`), the group that routes between
    them, and the trainer callbacks. `parameter_names` defaults to the optimizer's parameters' names."""
    if parameter_names is None:
        parameter_names = [p.name for p in optimizer.parameters] if optimizer is not None else []
    built = build(config, model, parameter_names, rank, logger, on_host, data_parallel, optimizer, global_batch_size,
                  outputs, features, layout)
    group = group_of(built)
    return Run(config, group, build_callbacks(group, config, features), built.parts)


def group_of(built: Build) -> MonitorGroup:
    actions = built.actions[0] if len(built.actions) == 1 else CombinedActions(built.actions) if built.actions else None
    return MonitorGroup(built.monitors, built.sinks, built.rank, built.logger, actions, built.services)


def build_callbacks(group: MonitorGroup, config: MindmonConfig, features: Sequence[Feature] = FEATURES) -> list:
    """The trainer callbacks: one that flushes the group at every step end (when it has monitors,
    or TensorBoard alone, which still gets the trainer's loss / lr / grad norm), and those the
    features ask for (the profiler's)."""
    from mindmon.core.trainer_callbacks import MonitorCallback

    callbacks = [MonitorCallback(group)] if group.active or config.monitor.tensorboard.enabled else []
    for feature in features:
        section = section_of(config, feature)
        if feature.callbacks is not None and section is not None:
            callbacks += feature.callbacks(group, section, group.logger)
    return callbacks
