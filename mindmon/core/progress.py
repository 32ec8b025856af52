"""Where this process's training is: the step and the phase it is in, and since when.

The training step's events set it (mindmon.core.group.MonitorGroup.emit) as they happen; the peer watchdog's
thread reads it for its heartbeat, so rank 0 can tell a rank that is stuck (alive, but in the same phase of
the same step for too long) from one that is slow, and say where each rank is. Setting it is two attribute
writes and one clock read: it costs nothing a step would notice, and the reader needs no lock because it
reads one tuple, replaced whole.
"""
import time
from typing import NamedTuple


class Place(NamedTuple):
    step: int          # the step in progress (the one being trained, or the last one written while waiting)
    phase: str         # one of PHASES
    since: float       # time.time() when the phase began


# The phases of a step, in the order a step passes them.
DATA = "data"                      # between steps: waiting for the next batch
FORWARD_BACKWARD = "forward_backward"  # a micro-batch's forward and backward
REDUCE = "reduce"                  # the gradients' collective over the ranks
UPDATE = "update"                  # clipping and the optimizer's update
MONITOR = "monitor"                # mindmon's own step-end work (records to every output)
PHASES = (DATA, FORWARD_BACKWARD, REDUCE, UPDATE, MONITOR)


class Progress:
    """This process's place. `enter` is called by the step's events; `place` is read by other threads."""

    def __init__(self):
        self.place = Place(0, DATA, time.time())

    def enter(self, step: int, phase: str) -> None:
        """A move: a new phase, or progress inside one (each micro-batch's end renews `forward_backward`, so
        a rank running many micro-batches is seen moving)."""
        self.place = Place(step, phase, time.time())


PROGRESS = Progress()   # the process's one training loop
