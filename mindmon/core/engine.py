"""The engine's two interfaces. A `Monitor` turns what the training loop hands it into records; a
`Sink` writes records somewhere (log lines, a file, TensorBoard, a database). `MonitorGroup` routes
between them and knows nothing else. The semantics of every record are in docs/semantics.md.

A step, as the group drives it:

    monitor.reset()                              step begin
    monitor.on_event(event)                      for each event whose type is in monitor.EVENTS
                                                 (mindmon.core.events: the training step's own vocabulary)
    monitor.record(key, value, context)          for each key in monitor.KEYS: a feature's hooks handing
                                                 their monitor data (tensor statistics, L2, collectives)
    monitor.cross_rank(K) / receive_cross_rank()  only with several ranks: its CrossRankPayload summed
                                                 inside the step's own collectives
    records = monitor.collect(step)              step end: everything the step produced, in one go
    sink.write(records); sink.flush()

Example (a monitor of the step's wall time, and a sink that prints):

    class StepTime(Monitor):
        KEYS = ("step_time",)
        def record(self, key, value=None, context=None):
            self.seconds = value
        def collect(self, step):
            return [Record(step, None, 0, "step_time", "seconds", self.seconds)]

    class Print(Sink):
        def write(self, records):
            for record in records:
                print(record)
"""
import abc
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from mindmon.core.records import Record


@dataclass(frozen=True)
class RunInfo:
    """What a sink may need to know about the run when it opens."""

    rank: int = 0
    start_step: int = 0                         # > 0: a resumed run, whose files are appended to
    max_steps: Optional[int] = None             # for `step:[  2/ 10]` prefixes
    global_batch_size: Optional[int] = None     # for the `vs samples` axis
    micro_steps_per_step: Optional[int] = None  # K, when the trainer knows it

    @property
    def resumed(self) -> bool:
        return self.start_step > 0


@dataclass(frozen=True)
class CrossRankSizes:
    """The number of values in each part of a monitor's `CrossRankPayload` (0: no such part)."""

    data_parallel: int = 0
    shards: int = 0
    job: int = 0

    @property
    def total(self) -> int:
        return self.data_parallel + self.shards + self.job


NO_CROSS_RANK = CrossRankSizes()


@dataclass
class CrossRankPayload:
    """Values a monitor has summed over ranks in one step, by the ranks they are summed over. Each part is a
    1-D float array (numpy, or a MindSpore Tensor that may stay on the device until the collective) of the
    size `Monitor.cross_rank_sizes` declared, or None (nothing, or zeros when a size was declared).

    - `data_parallel`: over the data-parallel group, inside the gradients' all-reduce (MoE step totals,
      loss components).
    - `shards`: over the tensor- and context-parallel groups, inside the model-parallel sums
      (mindmon.parallel.reduce): a split parameter's full squared norm from its shards'.
    - `job`: over every rank of the job: the data-parallel all-reduce, then each model-parallel group's
      sums. A buffer with one slot per rank, each rank filling its own, arrives as every rank's values
      on every rank (the groups form a grid).

    Every rank must send the same sizes, or the collective mixes up the ranks' values (or hangs): sizes
    come from what the monitor was built with and K, and the group sends zeros for a monitor switched off.

    Example (a monitor of each rank's step time, one slot per rank of the job):
        def cross_rank_sizes(self, num_micro_steps):
            return CrossRankSizes(job=self.world_size)
        def cross_rank(self, num_micro_steps):
            slots = np.zeros(self.world_size)
            slots[self.rank] = self.seconds
            return CrossRankPayload(job=slots)
        def receive_cross_rank(self, summed):
            self.every_rank = summed.job
    """

    data_parallel: Any = None
    shards: Any = None
    job: Any = None


class Monitor(abc.ABC):
    """Collects during a step, without host syncs, and returns the step's records at `collect`.

    `EVENTS` are the step events (mindmon.core.events) it takes, delivered to `on_event`; `KEYS` are the
    `record(key, ...)` keys its own hooks send it; the group calls each only for those.
    A monitor that needs values summed over ranks declares their sizes (`cross_rank_sizes`), gives its
    values at each step (`cross_rank`) and gets the sums back (`receive_cross_rank`); they ride in the
    collectives the training step makes anyway (`CrossRankPayload`).
    """

    EVENTS: Tuple[type, ...] = ()
    KEYS: Tuple[str, ...] = ()

    def reset(self) -> None:
        """Step begin: forget what the previous step left."""

    def on_event(self, event) -> None:
        """One of the step's events (an instance of a type in `EVENTS`)."""

    def record(self, key: str, value=None, context: Optional[dict] = None) -> None:
        """One value of the step; `context` may carry `micro_step`."""

    @abc.abstractmethod
    def collect(self, step: int) -> List[Record]:
        """Step end: the step's records (one host transfer at most), then ready for the next step."""

    def cross_rank_sizes(self, num_micro_steps: int) -> "CrossRankSizes":
        """How many values each part of `cross_rank` holds: from what the monitor was built with and K only,
        never from the step's data (it is asked of a monitor switched off too, which then sends zeros)."""
        return NO_CROSS_RANK

    def cross_rank(self, num_micro_steps: int) -> Optional["CrossRankPayload"]:
        """This rank's values to be summed over the ranks this step (None, or a part of the wrong size:
        zeros are sent in its place)."""
        return None

    def receive_cross_rank(self, summed: "CrossRankPayload") -> None:
        """The sums back (every declared part, as a 1-D float64 numpy array), before `collect`."""

    def close(self) -> None:
        """Train end: detach hooks, release what the monitor holds."""


class Service(abc.ABC):
    """Runs beside training for the group's life and takes no records (the peer watchdog's thread): the
    group starts it when it opens and stops it when it closes. Neither call may raise into training."""

    @abc.abstractmethod
    def start(self, run: RunInfo) -> None:
        pass

    @abc.abstractmethod
    def stop(self) -> None:
        pass


class SinkClosedError(RuntimeError):
    """A write to a sink (or group) after `close()`: the run's files are finished."""


class Sink(abc.ABC):
    """Writes records. `open` is called once before the first write, `flush` at every step end (a
    crash loses at most the step in flight), `close` once at train end.

    Every sink keeps the same contract, enforced here for each subclass's own methods: a second
    `close()` does nothing, and a `write()` after `close()` raises SinkClosedError (the run's files are
    finished; nothing starts a new one)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "write" in vars(cls):
            cls.write = _refused_after_close(cls.write)
        if "close" in vars(cls):
            cls.close = _closed_once(cls.close)

    _sink_closed = False   # set by close(); a class default, so subclasses need not call __init__ here

    @property
    def closed(self) -> bool:
        return self._sink_closed

    def open(self, run: RunInfo) -> None:
        pass

    @abc.abstractmethod
    def write(self, records: Sequence[Record]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._sink_closed = True


def _refused_after_close(write):
    if getattr(write, "checks_closed", False):
        return write

    def checked(self, records):
        if self.closed:
            raise SinkClosedError(f"mindmon: {type(self).__name__}: write after close(); its output is finished")
        return write(self, records)

    checked.checks_closed = True
    checked.__doc__, checked.__name__, checked.__qualname__ = write.__doc__, write.__name__, write.__qualname__
    return checked


def _closed_once(close):
    if getattr(close, "checks_closed", False):
        return close

    def once(self):
        if self.closed:
            return None
        try:
            return close(self)
        finally:
            self._sink_closed = True

    once.checks_closed = True
    once.__doc__, once.__name__, once.__qualname__ = close.__doc__, close.__name__, close.__qualname__
    return once


@dataclass(frozen=True)
class Feature:
    """One capability's registration (mindmon/features/__init__.py lists them): its configuration section
    and how the factory builds its parts. See docs/architecture.md, "Adding a capability".

    Example:
        FEATURE = Feature("step_time", path="monitor.step_time", parse=StepTimeConfig.parse, build=build)
    """

    name: str
    # Where its section sits: "monitor.<key>" under `monitor:`, "<key>" at the top, "callbacks" for a
    # feature declared as a trainer callback; None when it has no section of its own.
    path: Optional[str] = None
    # (path, the value in the config or None when absent) -> its section: None, or an object with
    # `active` and `to_dict()`. Raises ConfigError.
    parse: Optional[Callable[[str, Any], Any]] = None
    # (the raw config, the parsed MindmonConfig) -> MindmonConfig: a dialect mapped onto other sections.
    translate: Optional[Callable[[dict, Any], Any]] = None
    # (mindmon.core.factory.Build, its section) -> None: adds its monitors, sinks and actions to the build.
    build: Optional[Callable[[Any, Any], None]] = None
    # (the MonitorGroup, its section, the logger) -> the trainer callbacks it needs besides the group's.
    callbacks: Optional[Callable[[Any, Any, Any], list]] = None
    # The smallest training config that switches it on: docs, and the contract tests that build every
    # registered feature from it.
    example: Optional[dict] = None


class CombinedActions:
    """Several action objects (the alert actions, the step guard) as one: each is asked every time,
    because each may take part in a collective. An action object has `should_skip_update(grad_norm)`
    (before the update) and `should_stop()` (after the step), asked on every rank at every step."""

    def __init__(self, members: Sequence):
        self.members = [m for m in members if m is not None]

    def should_skip_update(self, grad_norm) -> bool:
        return any([m.should_skip_update(grad_norm) for m in self.members])

    def should_stop(self) -> bool:
        return any([m.should_stop() for m in self.members])
