"""MonitorGroup: builds the active monitors from config and routes the trainer's record calls.

It keeps the record protocol of the newer upstream MindFormers trainer (`setup, reset,
record(key, value=None, context=None), flush(step), close, set_model, should_record, active`),
so it can stand in for that trainer's monitor.
"""
import logging
from typing import List, Optional, Sequence

import numpy as np

from .config import ConfigError, MonitorConfig, ProfilerConfig
from .distributed import DataParallel
from .monitors import MoETokensMonitor, TrainStateMonitor
from .sinks import JsonlSink, LogSink, MegatronTokensPerExpertSink
from .stats import host_is_device


class _RankTagged(logging.LoggerAdapter):
    """Python's logger does not say which process wrote a line; MindFormers' does (rank_<r>/ files)."""

    def process(self, msg, kwargs):
        return f"[rank {self.extra['rank']}] {msg}", kwargs


def _default_logger(rank: int, several_ranks: bool):
    logger = logging.getLogger("mindmon")
    return _RankTagged(logger, {"rank": rank}) if several_ranks else logger


class MonitorGroup:
    """The monitors a config asks for, and the sinks they write to (one set per rank).

    Only active pieces are built: with every switch off, `active` is False and the trainer can
    skip all recording. A monitor that raises is logged once and dropped; training goes on and
    what was already written stays.

    Example:
        group = MonitorGroup(MonitorConfig.parse({"train_state": {"local_loss": True}}),
                             parameter_names=[p.name for p in optimizer.parameters])
        group.setup()
        group.record("local_loss", loss, {"micro_step": 0})
        group.flush(step=1)
        group.close()
    """

    def __init__(self, config: MonitorConfig, model=None, parameter_names: Sequence[str] = (),
                 rank: Optional[int] = None, logger: Optional[logging.Logger] = None, on_host: Optional[bool] = None,
                 profiler: Optional[ProfilerConfig] = None, data_parallel: Optional[DataParallel] = None):
        self.config = config
        self.data_parallel = data_parallel or DataParallel(config.data_parallel_group)
        self.profiler = profiler  # the `profiler:` section; None = no profiling
        self.model = model
        self.rank = self.data_parallel.rank if rank is None else rank  # default: this process's rank
        self.logger = logger or _default_logger(self.rank, self.data_parallel.active)
        self.monitors = self._build_monitors(parameter_names, on_host) if config.selects_rank(self.rank) else []
        # Fixed at build time, so every rank sends the same payload even after a monitor is dropped.
        self._cross_rank = [(m, m.cross_rank_shapes()) for m in self.monitors if hasattr(m, "cross_rank_shapes")]
        self.sinks: List = []

    def _build_monitors(self, parameter_names: Sequence[str], on_host: Optional[bool]) -> list:
        config, monitors = self.config, []
        on_host = host_is_device() if on_host is None and config.active else on_host
        if config.train_state.active:
            monitors.append(TrainStateMonitor(config.train_state, parameter_names, self.rank, on_host))
        if config.moe_monitor.active:
            if self.model is None:
                raise ConfigError("monitor.moe_monitor: save_tokens_per_expert_interval is set but no model "
                                  "was given to MonitorGroup; pass model= so its MoE layers can be found")
            # Cross-rank totals need every rank in the collective: only when all ranks collect.
            cross_rank = self.data_parallel.active and config.ranks is None
            monitors.append(MoETokensMonitor(config.moe_monitor, self.model, self.rank, on_host, self.logger,
                                             cross_rank))
        return monitors

    @property
    def active(self) -> bool:
        return bool(self.monitors)

    def should_record(self, key: str) -> bool:
        return any(key in monitor.KEYS for monitor in self.monitors)

    def callbacks(self) -> list:
        """The callbacks to register with the trainer: one that flushes at every step end, and the
        profiler's when `enable_profiling` is on and this rank is in `profiler_rank`."""
        from .callbacks import MonitorCallback, ProfilerCallback

        wanted = self.active or self.config.tensorboard.enabled  # TensorBoard alone still gets loss/lr/grad-norm
        callbacks = [MonitorCallback(self)] if wanted else []
        if self.profiler is not None and self.profiler.enable_profiling and self.profiler.selects_rank(self.rank):
            callbacks.append(ProfilerCallback(self.profiler, self.rank, self.logger))
        return callbacks

    def set_model(self, model) -> None:
        self.model = model

    def setup(self, start_step: int = 0, global_batch_size: Optional[int] = None) -> None:
        """Open the sinks; a run resumed past step 0 appends to its metrics file. `global_batch_size`
        (when the trainer knows it) gives TensorBoard its `vs samples` axis."""
        if not self.sinks:
            append = start_step > 0
            self.sinks = [LogSink(self.logger), JsonlSink(self.config.output_dir, self.rank, append)]
            if self.config.tensorboard.enabled:
                from .sinks.tensorboard import TensorBoardSink

                tensorboard = self.config.tensorboard
                self.sinks.append(TensorBoardSink(tensorboard.tensorboard_dir, self.rank,
                                                  tensorboard.tensorboard_log_interval,
                                                  tensorboard.tensorboard_queue_size, global_batch_size))
            if self.config.moe_monitor.active:
                self.sinks.append(MegatronTokensPerExpertSink(self.config.output_dir, self.rank, append))

    def reset(self) -> None:
        for monitor in list(self.monitors):
            self._guard(monitor, monitor.reset)

    def record(self, key: str, value=None, context=None) -> None:
        for monitor in list(self.monitors):
            if key in monitor.KEYS:
                self._guard(monitor, monitor.record, key, value, context)

    def cross_rank_sums(self) -> list:
        """Tensors the monitors want summed over the data-parallel group this step; the trainer packs
        them into its gradient all-reduce and hands the sums back to `receive_cross_rank_sums`."""
        from mindspore import Tensor

        payload = []
        for monitor, shapes in self._cross_rank:
            values = self._guard(monitor, monitor.cross_rank_sums) if monitor in self.monitors else None
            if values is None or [tuple(v.shape) for v in values] != shapes:
                values = [Tensor(np.zeros(shape, np.float32)) for shape in shapes]
            payload += values
        return payload

    def receive_cross_rank_sums(self, sums: Sequence) -> None:
        start = 0
        for monitor, shapes in self._cross_rank:
            part, start = list(sums[start:start + len(shapes)]), start + len(shapes)
            if monitor in self.monitors:
                self._guard(monitor, monitor.receive_cross_rank_sums, part)

    def flush(self, step: int) -> None:
        records = []
        for monitor in list(self.monitors):
            records += self._guard(monitor, monitor.collect, step) or []
        self.write(records)

    def write(self, records) -> None:
        """Send records to every sink; callbacks outside the group (MaxLogitsMonitor) use it too."""
        if not self.sinks:
            self.setup()
        for sink in self.sinks:
            try:
                sink.write(records)
            except Exception:  # a broken sink must not stop training
                self.logger.exception("mindmon: writing to %s failed; training goes on", type(sink).__name__)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def _guard(self, monitor, method, *args):
        try:
            return method(*args)
        except Exception:
            self.logger.exception("mindmon: %s failed and is switched off; training goes on, "
                                  "records already written are kept", type(monitor).__name__)
            self.monitors.remove(monitor)
            return None
