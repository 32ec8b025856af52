"""`tracker_backlog`: how many steps each tracker still has queued at step end (name: the tracker). A tracker
on a slow network falls behind without slowing training; this says by how much, in the run's own files."""
from typing import List, Sequence

from mindmon.core.engine import Monitor
from mindmon.core.records import Record

TRACKER_BACKLOG = "tracker_backlog"


class TrackerBacklogMonitor(Monitor):
    def __init__(self, rank: int, trackers: Sequence):
        self.rank = rank
        self.trackers = list(trackers)   # mindmon.features.trackers.worker.TrackerSink

    def collect(self, step: int) -> List[Record]:
        return [Record(step, None, self.rank, TRACKER_BACKLOG, tracker.NAME, float(tracker.backlog))
                for tracker in self.trackers if not tracker.closed]
