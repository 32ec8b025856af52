"""The experiment trackers' common part: the training thread only turns a step's records into
`{tag: value}` (the TensorBoard tags) and queues them; one thread of the sink's own talks to the tracker.
A tracker that fails, hangs or whose files cannot be written never raises into the step nor holds it up:
its failure is raised at the next `write` (or `close`), where MonitorGroup switches the sink off with one
line, and what the tracker already has stays."""
import logging
import queue
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from mindmon.core.engine import RunInfo, Sink
from mindmon.core.records import Record
from mindmon.sinks.tensorboard import record_tags

QUEUED_STEPS = 1000   # steps waiting for a slow tracker; past that the oldest are dropped
_CLOSE = object()


class TrackerError(RuntimeError):
    """The tracker failed on its own thread; the message says which and why."""


def step_scalars(records: Sequence[Record]) -> Dict[int, Dict[str, float]]:
    """The step-level records (micro_step None) as {step: {TensorBoard tag: value}}. Per-micro-step values
    stay in the run's JSONL and TensorBoard: a tracker's x axis is the training step."""
    steps: Dict[int, Dict[str, float]] = {}
    for record in records:
        if record.micro_step is None:
            for tag, value in record_tags(record):
                steps.setdefault(record.step, {})[tag] = float(value)
    return steps


class TrackerSink(Sink):
    """Subclasses give `NAME` and the tracker's calls, all made on the sink's thread: `start(run)`,
    `log(step, scalars)`, `finish()` (normal end) and `abandon()` (after a failure: release what can be)."""

    NAME = "tracker"

    def __init__(self, close_timeout: float, logger=None):
        self.close_timeout = close_timeout
        self.logger = logger or logging.getLogger("mindmon")
        self.delivered_steps = 0
        self._queue: "queue.Queue" = queue.Queue(QUEUED_STEPS)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._reported = False
        self._dropped = 0
        self._run = RunInfo()

    # the tracker's calls (on the sink's thread)
    def start(self, run: RunInfo) -> None:
        raise NotImplementedError

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    @property
    def backlog(self) -> int:
        """Steps queued and not yet handed to the tracker."""
        return self._queue.qsize()

    # the Sink (on the training thread)
    def open(self, run: RunInfo) -> None:
        self._run = run
        self._thread = threading.Thread(target=self._work, name=f"mindmon-{self.NAME}", daemon=True)
        self._thread.start()

    def write(self, records: Sequence[Record]) -> None:
        self._raise_failure()
        for step, scalars in step_scalars(records).items():
            self._put((step, scalars))

    def close(self) -> None:
        if self._thread is None or self._reported:
            return
        self._put(_CLOSE)
        self._thread.join(self.close_timeout)
        if self._thread.is_alive():
            self.logger.error("mindmon: %s did not finish within %.0f s (close_timeout); %d queued step(s) and its "
                              "closing calls are left to it", self.NAME, self.close_timeout, self._queue.qsize())
            return
        self._raise_failure()

    def _put(self, item) -> None:
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        try:
            dropped = self._queue.get_nowait()
        except queue.Empty:
            return
        if dropped is _CLOSE:   # (never dropped: put back, the step is dropped instead)
            self._queue.put_nowait(dropped)
            return
        if self._dropped == 0:
            self.logger.warning("mindmon: %s is not keeping up (%d steps queued); the oldest queued steps are "
                                "dropped, training goes on", self.NAME, QUEUED_STEPS)
        self._dropped += 1

    def _raise_failure(self) -> None:
        if self._error is not None and not self._reported:
            self._reported = True
            error = self._error
            raise TrackerError(f"{self.NAME}: {type(error).__name__}: {error}; {self.delivered_steps} step(s) "
                               f"were delivered") from None

    def _work(self) -> None:
        try:
            self.start(self._run)
            while True:
                item = self._queue.get()
                if item is _CLOSE:
                    break
                self.log(*item)
                self.delivered_steps += 1
            self.finish()
        except BaseException as error:   # the tracker's own failures, whatever they are, end here
            self._error = error
            try:
                self.abandon()
            except BaseException:
                pass


def flatten(mapping: dict, prefix: str = "") -> List[Tuple[str, object]]:
    """A nested config as (`a.b.c`, value) pairs: a tracker's parameters."""
    pairs: List[Tuple[str, object]] = []
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            pairs += flatten(value, name + ".")
        else:
            pairs.append((name, value))
    return pairs
