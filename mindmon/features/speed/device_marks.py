"""The device's own clock for a step's device phases (forward_backward, micro_batch, reduce, update) on an
asynchronous device.

On Ascend and GPU the host runs ahead of the device: when the group stamps an event the device may still
be working on what the host enqueued before it, so host stamps would time the launching, not the work.
There, each phase boundary also records a `mindspore.runtime.Event(enable_timing=True)` on the current
stream (recording enqueues a marker; it does not wait), and the phase's time is the device's elapsed time
between two markers, read at the step's end (`SpeedMonitor.collect`), after the step's own host reads of
its loss and gradient norm. A marker enqueued after those reads (the update's end) may still be running
then; `elapsed_time` waits for it, the one wait this adds, and at most the update's tail.

On CPU MindSpore has no device events (`Event` fails: "CPU device is not supported"), the host stamps are
the work's own times, and `for_device_target` gives None: nothing is created, nothing waits. The device
path has not run on the CPU machine mindmon is tested on.
"""
import logging
from typing import Optional

from mindmon.core.events import GradientsReduced, MicroBatchEnd, ReduceBegin, StepBegin, UpdateDone

logger = logging.getLogger("mindmon")

DEVICE_TARGETS = ("Ascend", "GPU")
# The events that bound a phase of device work; the data wait and mindmon's own time stay on the host clock.
BOUNDARIES = (StepBegin, MicroBatchEnd, ReduceBegin, GradientsReduced, UpdateDone)


class DeviceMarks:
    """One step's device markers, by event.

    Example (what SpeedMonitor does):
        marks = DeviceMarks.for_device_target()    # None on CPU
        marks.record(event)                         # at every event the monitor receives
        marks.seconds(begin, end)                   # at step end: device seconds, None without both markers
        marks.clear()                               # at the next step's reset
    """

    def __init__(self, runtime):
        self.runtime = runtime           # mindspore.runtime
        self._marks: dict = {}           # id(event) -> its Event; the monitor holds the events until clear()
        self.failed = False

    @classmethod
    def for_device_target(cls, target: Optional[str] = None) -> Optional["DeviceMarks"]:
        import mindspore as ms

        if (target or ms.get_context("device_target")) not in DEVICE_TARGETS:
            return None
        from mindspore import runtime

        return cls(runtime)

    def record(self, event) -> None:
        if self.failed or not isinstance(event, BOUNDARIES):
            return
        try:
            mark = self.runtime.Event(enable_timing=True)
            mark.record()
        except Exception as error:   # a runtime without timing events: the host stamps, said once
            self._fail(error)
            return
        self._marks[id(event)] = mark

    def seconds(self, start, end) -> Optional[float]:
        """The device's seconds from `start`'s marker to `end`'s; None when either has none."""
        first, last = self._marks.get(id(start)), self._marks.get(id(end))
        if self.failed or first is None or last is None:
            return None
        try:
            return first.elapsed_time(last) / 1000.0   # milliseconds
        except Exception as error:
            self._fail(error)
            return None

    def clear(self) -> None:
        self._marks = {}

    def _fail(self, error: BaseException) -> None:
        self.failed, self._marks = True, {}
        logger.warning("mindmon: monitor.speed: the device's timing events cannot be used (%s: %s); the step's "
                       "phases are timed on the host", type(error).__name__, error)
