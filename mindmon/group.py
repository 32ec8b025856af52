"""MonitorGroup: builds the active monitors from config and routes the trainer's record calls.

It keeps the record protocol of the newer upstream MindFormers trainer (`setup, reset,
record(key, value=None, context=None), flush(step), close, set_model, should_record, active`),
so it can stand in for that trainer's monitor.
"""
import logging
from typing import List, Optional, Sequence

from .config import MonitorConfig, ProfilerConfig
from .monitors import TrainStateMonitor
from .sinks import JsonlSink, LogSink
from .stats import host_is_device


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
                 rank: int = 0, logger: Optional[logging.Logger] = None, on_host: Optional[bool] = None,
                 profiler: Optional[ProfilerConfig] = None):
        self.config = config
        self.profiler = profiler  # the `profiler:` section; None = no profiling
        self.model = model
        self.rank = rank
        self.logger = logger or logging.getLogger("mindmon")
        self.monitors = []
        if config.train_state.active:
            on_host = host_is_device() if on_host is None else on_host
            self.monitors.append(TrainStateMonitor(config.train_state, parameter_names, rank, on_host))
        self.sinks: List = []

    @property
    def active(self) -> bool:
        return bool(self.monitors)

    def should_record(self, key: str) -> bool:
        return any(key in monitor.KEYS for monitor in self.monitors)

    def callbacks(self) -> list:
        """The callbacks to register with the trainer: one that flushes at every step end, and the
        profiler's when `enable_profiling` is on and this rank is in `profiler_rank`."""
        from .callbacks import MonitorCallback, ProfilerCallback

        callbacks = [MonitorCallback(self)] if self.active else []
        if self.profiler is not None and self.profiler.enable_profiling and self.profiler.selects_rank(self.rank):
            callbacks.append(ProfilerCallback(self.profiler, self.rank, self.logger))
        return callbacks

    def set_model(self, model) -> None:
        self.model = model

    def setup(self, start_step: int = 0) -> None:
        """Open the sinks; a run resumed past step 0 appends to its metrics file."""
        if not self.sinks:
            self.sinks = [LogSink(self.logger), JsonlSink(self.config.output_dir, self.rank, append=start_step > 0)]

    def reset(self) -> None:
        for monitor in list(self.monitors):
            self._guard(monitor, monitor.reset)

    def record(self, key: str, value=None, context=None) -> None:
        for monitor in list(self.monitors):
            if key in monitor.KEYS:
                self._guard(monitor, monitor.record, key, value, context)

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
