"""MonitorGroup: routes the training loop's record calls to its monitors and their records to its sinks.

It is handed its monitors and sinks (mindmon.core.factory builds them from a config) and does nothing
else. It keeps the record protocol of the newer upstream MindFormers trainer (`setup, reset,
record(key, value=None, context=None), flush(step), close, should_record, active`), so it can stand
in for that trainer's monitor. A monitor that raises is logged once and dropped; a sink that fails
while writing is logged once and dropped; training goes on and what was already written stays.
"""
import gc
import logging
import time
from contextlib import contextmanager
from typing import List, Optional, Sequence

from mindmon.core.cross_rank import CrossRankExchange
from mindmon.core.engine import Monitor, RunInfo, Service, Sink, SinkClosedError
from mindmon.core.events import StepBegin, StepEnd, StepEvent, StepWritten, from_record
from mindmon.core.progress import PROGRESS
from mindmon.core.records import Record


class MonitorGroup:
    """Example (a plain loop; `mindmon.build_group` makes the same from a config):

        group = MonitorGroup([TrainStateMonitor(config.train_state, names)], [JsonlSink("./out")])
        group.setup(max_steps=100)
        group.emit(MicroBatchLoss(0, loss))
        group.flush(step=1, loss=loss, grad_norm=grad_norm, learning_rate=1e-3)
        group.close()
    """

    def __init__(self, monitors: Sequence[Monitor] = (), sinks: Sequence[Sink] = (), rank: int = 0,
                 logger: Optional[logging.Logger] = None, actions=None, services: Sequence[Service] = ()):
        self.monitors: List[Monitor] = list(monitors)
        self.services: List[Service] = list(services)   # started at setup, stopped at close
        self.actions = actions   # the alert sink's opt-in actions (mindmon.features.alerts.actions), or None
        self.sinks: List[Sink] = list(sinks)
        self.rank = rank
        self.logger = logger or logging.getLogger("mindmon")
        # Every monitor built, switched off or not: each declares its cross-rank sizes, so every rank's
        # collectives keep their size (mindmon.core.cross_rank).
        self.built: List[Monitor] = list(self.monitors)
        self._opened = False
        self._closed = False
        self._run = RunInfo(rank)
        self._max_norm: Optional[float] = None
        self._step_values_failed = False
        self._step = 0              # the step in progress: the last one flushed + 1
        self._own_seconds = 0.0     # mindmon's time in emit/record/flush since the last StepEnd

    @property
    def active(self) -> bool:
        return bool(self.monitors)

    def should_record(self, key: str) -> bool:
        """A monitor takes this `record` key (its own hooks' data), or the event the key stands for."""
        event = from_record(key)
        if event is not None:
            return self.should_take(type(event))
        return any(key in monitor.KEYS for monitor in self.monitors)

    def should_take(self, event_type: type) -> bool:
        """A monitor takes this step event: the loop may skip making its payload otherwise."""
        return any(issubclass(event_type, monitor.EVENTS) for monitor in self.monitors)

    def should_stop(self) -> bool:
        """After `flush(step)`: True when an alert asks to stop training (`stop_on_anomaly`), on every
        rank at the same step. Every rank must ask at every step."""
        return self.actions is not None and self.actions.should_stop()

    def should_skip_update(self, grad_norm: float) -> bool:
        """Before the update: True when an action (an alert's skip_nonfinite_update, monitor_config's spike
        or NaN check) asks to skip it. Every rank must ask at every step."""
        return self.actions is not None and bool(self.actions.should_skip_update(grad_norm))

    def setup(self, start_step: int = 0, global_batch_size: Optional[int] = None, max_steps: Optional[int] = None,
              micro_steps_per_step: Optional[int] = None) -> None:
        """Open the sinks (a run resumed past step 0 appends to its files). A directory that cannot be
        written raises ConfigError naming its key, before step 1."""
        if self._opened:
            return
        run = self._run = RunInfo(self.rank, start_step, max_steps, global_batch_size, micro_steps_per_step)
        self._step = start_step + 1
        for sink in self.sinks:
            sink.open(run)
        for service in self.services:
            self._service_call(service, service.start, run)
        self._opened = True

    def reset(self) -> None:
        for monitor in list(self.monitors):
            self.guard(monitor, monitor.reset)

    def emit(self, event: StepEvent) -> None:
        """One of the step's events (mindmon.core.events) to every monitor that takes its type. `StepBegin` also
        resets the monitors. The event's `at` is stamped here; its phase becomes this process's place
        (mindmon.core.progress), which the peer watchdog reports."""
        if isinstance(event, StepBegin):
            self.reset()
        self._deliver(event)

    def _deliver(self, event: StepEvent) -> None:
        started = event.at = time.perf_counter()
        event.mindmon_seconds = self._own_seconds
        if event.PHASE is not None:
            PROGRESS.enter(self._step, event.PHASE)
        for monitor in list(self.monitors):
            if isinstance(event, monitor.EVENTS):
                self.guard(monitor, monitor.on_event, event)
        self._own_seconds += time.perf_counter() - started

    def record(self, key: str, value=None, context=None) -> None:
        """The MindFormers monitor protocol: a step's key (`local_loss`, `local_norm`, `device_loss`,
        `device_norm`, `moe_tpe_step_begin`, `moe_tpe`, `loss_components`, `loss_scale`) is emitted as its
        event (mindmon.core.events.from_record); any other key goes to the monitors whose `KEYS` have it."""
        event = from_record(key, value, context)
        if event is not None:   # (not `emit`: the protocol resets with its own call)
            self._deliver(event)
            return
        started = time.perf_counter()
        for monitor in list(self.monitors):
            if key in monitor.KEYS:
                self.guard(monitor, monitor.record, key, value, context)
        self._own_seconds += time.perf_counter() - started

    def cross_rank(self, num_micro_steps: int) -> CrossRankExchange:
        """This step's cross-rank payloads of the monitors (mindmon.core.engine.CrossRankPayload), which the
        training step packs into its collectives and hands back with `deliver()`."""
        return CrossRankExchange(self, num_micro_steps)

    def count_own_time(self, seconds: float) -> None:
        """Time spent for mindmon outside emit/record/flush (making the cross-rank payloads)."""
        self._own_seconds += seconds

    def set_max_norm(self, max_norm: float) -> None:
        """The clipping threshold of the run's train step (0: clipping off). `AccumulatingTrainStep`
        calls this when it is given the group; a `max_norm` record then goes out next to every step's
        `grad_norm`, so the files say where the gradient was clipped."""
        self._max_norm = float(max_norm)

    def flush(self, step: int, loss=None, grad_norm=None, learning_rate=None) -> None:
        """Step end: the step's own values (when given: floats or one-element Tensors; `grad_norm` is
        the global norm before clipping, as `AccumulatingTrainStep` returns it) and every monitor's
        records to every sink, then the sinks flush."""
        self._step = step
        end = StepEnd(step, self._own_seconds, self._run.max_steps)
        self._deliver(end)
        started = end.at
        with _no_cycle_collection():
            self._write_step(step, loss, grad_norm, learning_rate)
        self._step = step + 1
        self._own_seconds = time.perf_counter() - started   # the writing: the next window's mindmon time
        self._deliver(StepWritten(step))

    def _write_step(self, step: int, loss, grad_norm, learning_rate) -> None:
        """`flush`'s work, in a function of its own: its records are freed when it returns, before the
        collector is switched back on."""
        records = self._step_values(step, loss, grad_norm, learning_rate)
        for monitor in list(self.monitors):
            records += self.guard(monitor, monitor.collect, step) or []
        self.write(records)
        for sink in list(self.sinks):
            self._sink_call(sink, sink.flush)

    def _step_values(self, step: int, loss, grad_norm, learning_rate) -> List[Record]:
        if loss is None and grad_norm is None and learning_rate is None:
            return []
        from mindmon.core.step_values import step_value_records

        try:
            return step_value_records(step, self.rank, loss, grad_norm, learning_rate,
                                      self._run.global_batch_size, self._max_norm)
        except Exception:  # a value in an unexpected shape must not stop training; said once, not every step
            if not self._step_values_failed:
                self.logger.exception("mindmon: could not record the step's loss/grad norm/lr; training goes on")
            self._step_values_failed = True
            return []

    def write(self, records: Sequence[Record]) -> None:
        """Send records to every sink (the step-end callback adds the trainer's own values here)."""
        if self._closed:
            raise SinkClosedError("mindmon: MonitorGroup.write after close(): the run's outputs are finished")
        self.setup()
        for sink in list(self.sinks):
            self._sink_call(sink, sink.write, records)

    def close(self) -> None:
        """Train end. Never raises: a failure here is logged and the user's code after training runs."""
        if self._closed:
            return
        self._closed = True
        for monitor in self.monitors:
            self.guard(monitor, monitor.close)
        for sink in list(self.sinks):
            self._sink_call(sink, sink.close)
        self.sinks = []
        for service in self.services:
            self._service_call(service, service.stop)

    def _service_call(self, service: Service, method, *args) -> None:
        try:
            method(*args)
        except Exception as error:  # a service runs beside training and must never stop it
            self.logger.error("mindmon: %s failed (%s: %s); training goes on without it", type(service).__name__,
                              type(error).__name__, error)

    def _sink_call(self, sink: Sink, method, *args) -> None:
        try:
            method(*args)
        except Exception as error:  # a full disk or a dead server must not stop training
            self.logger.error("mindmon: %s failed (%s: %s); it is switched off, training goes on and what it "
                              "already wrote is kept", type(sink).__name__, type(error).__name__, error)
            self.sinks.remove(sink)
            if method != sink.close:
                try:
                    sink.close()
                except Exception:
                    pass

    def guard(self, monitor: Monitor, method, *args):
        """`method(*args)` of a monitor; if it raises, the monitor is switched off and None returned."""
        try:
            return method(*args)
        except Exception as error:
            self.switch_off(monitor, error)
            return None

    def switch_off(self, monitor: Monitor, error: BaseException) -> None:
        """The one failure policy for a monitor, and for the hooks that feed it: logged once, with why,
        and switched off; training goes on and the records already written are kept."""
        if monitor not in self.monitors:
            return
        self.logger.error("mindmon: %s failed and is switched off; training goes on, records already written "
                          "are kept", type(monitor).__name__, exc_info=(type(error), error, error.__traceback__))
        self.monitors.remove(monitor)


@contextmanager
def _no_cycle_collection():
    """Python's cycle collector paused while a step's records are made, written and dropped. They form no
    cycles (reference counting frees them), but a step end makes thousands of them (2,828 rows per step for
    activations), and every 700 allocations the collector ran, and moved the records alive at that moment
    to older generations, which brought on a collection of every object in the process (about 0.1 s
    here) every few steps. The setting the program had is restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
