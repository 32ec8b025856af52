"""SpeedMonitor: where one rank's step time goes, its throughput and memory, and, on rank 0, the spread of
those over every rank of the job and the slow rank.

Every time comes from the step events' own timestamps (`event.at`, taken by the group as it receives
them), so the monitor adds no clock read and no synchronisation of its own; on Ascend and GPU the phases of
device work are the device's own times between markers recorded at the same events (device_marks.py). A
step's window runs from the previous StepEnd to its own; its phases (docs/semantics.md, "Step time") split
it with nothing left over:

    data              previous StepWritten  -> StepBegin            waiting for the next batch
    forward_backward  StepBegin / MicroBatchEnd(k-1) -> MicroBatchEnd(k), one per micro-batch
    reduce            ReduceBegin -> GradientsReduced               the gradients' collective
    update            GradientsReduced -> UpdateDone                global norm, clipping, optimizer
    mindmon           mindmon's own time in the window (its event handling, the previous step's writing)
    other             the rest (the loop's own code between the update and the step's end)

mindmon's time inside a phase's interval is taken out of that phase and counted under `mindmon`.

Across ranks, each rank's row rides in the step's own collectives (the `job` part of its CrossRankPayload:
one slot per rank of the job, summed over the data-parallel group and then every model-parallel group, so
the sum is every rank's row): the computing time before the collective of this step, and the previous
step's phases and throughput (the current step's are not over yet when the collective runs). Rank 0 writes their min / mean / max and the ranks of the extremes, and names a rank
whose computing time exceeds `slow_rank_factor` times the median: all-reduce makes every rank's wall time
equal, so the slow rank is the one that computed longest (and waited least inside the collective).
"""
import time
from collections import deque
from typing import Callable, List, Optional

import numpy as np

from mindmon.core.engine import NO_CROSS_RANK, CrossRankPayload, CrossRankSizes, Monitor
from mindmon.core.events import (GradientsReduced, MicroBatchEnd, ReduceBegin, StepBegin, StepEnd, StepWritten,
                            UpdateDone)
from mindmon.features.across_ranks.summaries import Column, summary_records
from mindmon.features.speed.device_marks import DeviceMarks
from mindmon.features.speed.memory import MemoryPeaks
from mindmon.core.records import (ETA, FLOPS, MEMORY, MFU, SLOW_RANK, STEP_TIME, THROUGHPUT, THROUGHPUT_DROP, WALL_CLOCK,
                             Record)

RECENT_STEPS = 20          # the steps a throughput is compared with
MIN_STEPS_FOR_DROP = 3     # none is judged before this many steps were measured
PHASES = ("data", "forward_backward", "reduce", "update", "mindmon", "other")
RATES = ("samples_per_second", "tokens_per_second", "job_samples_per_second", "job_tokens_per_second")
# A rank's row in the cross-rank buffer: this step's computing time, then the previous step's figures.
ROW = ("compute",) + ("step",) + PHASES + RATES


def _between(start, end) -> float:
    """Seconds from one event to the next, less mindmon's own time between them."""
    own = end.mindmon_seconds - start.mindmon_seconds if end.mindmon_seconds >= start.mindmon_seconds else 0.0
    return max(end.at - start.at - own, 0.0)


class SpeedMonitor(Monitor):
    """Example (what the group does; the loop only emits the step's events):
        monitor = SpeedMonitor(rank=0)
        for event in (StepBegin(), MicroBatchEnd(0, 8, 1024), ReduceBegin(), GradientsReduced(), UpdateDone(),
                      StepEnd(1)):
            monitor.on_event(event)
        records = monitor.collect(1)   # step_time/*, throughput/*, wall_clock, memory, eta
    """

    EVENTS = (StepBegin, MicroBatchEnd, ReduceBegin, GradientsReduced, UpdateDone, StepEnd, StepWritten)

    def __init__(self, rank: int = 0, data_parallel=None, global_batch_size: Optional[int] = None,
                 slow_rank_factor: float = 1.2, memory: Optional[MemoryPeaks] = None, flops=None,
                 peak_flops_per_second: Optional[float] = None, routed: Optional[Callable[[], Optional[dict]]] = None,
                 throughput_drop: float = 0.5, layout=None):
        """`flops`: a mindmon.features.speed.flops.FlopCounter attached to the model, or None; `routed`: this
        step's tokens per expert by MoE layer, read at StepEnd (before the MoE monitor lets them go);
        `data_parallel` (None: this rank alone) and `layout` (a mindmon.parallel.ParallelLayout, or None):
        the ranks compared."""
        self.rank = rank
        self.flops, self.peak, self.routed = flops, peak_flops_per_second, routed
        self._routed_now: Optional[dict] = None
        self.throughput_drop = throughput_drop
        self._recent_rates: deque = deque(maxlen=RECENT_STEPS)
        self.data_parallel = data_parallel if data_parallel is not None and data_parallel.active else None
        # The rows compared across ranks: one per rank of the job (its slot: the world rank) under model
        # parallelism, else one per data-parallel rank.
        if layout is not None and layout.model_parallel:
            self.slots, self.slot = _world_size(layout), layout.rank
        elif self.data_parallel is not None:
            self.slots, self.slot = self.data_parallel.size, self.data_parallel.rank
        else:
            self.slots, self.slot = 1, 0
        self.global_batch_size = global_batch_size
        self.slow_rank_factor = slow_rank_factor
        self.memory = memory if memory is not None else MemoryPeaks()
        self.device_marks = DeviceMarks.for_device_target()   # None on CPU: the host stamps are the work's times
        self._written: Optional[StepWritten] = None     # the previous step's end of writing
        self._last_end: Optional[StepEnd] = None
        self._first_end: Optional[StepEnd] = None
        self._previous_row: Optional[np.ndarray] = None  # the last step's figures, for the next collective
        self._events: dict = {}
        self._micro: List[MicroBatchEnd] = []
        self._rows: Optional[np.ndarray] = None

    def reset(self) -> None:
        self._events, self._micro, self._rows = {}, [], None
        if self.device_marks is not None:
            self.device_marks.clear()

    def on_event(self, event) -> None:
        if self.device_marks is not None:
            self.device_marks.record(event)
        if isinstance(event, MicroBatchEnd):
            self._micro.append(event)
        elif isinstance(event, StepWritten):
            self._written = event
        else:
            if isinstance(event, StepEnd) and self.routed is not None:
                self._routed_now = self.routed()
            self._events[type(event)] = event

    # One row per rank of the job, this rank's in its own slot.
    def cross_rank_sizes(self, num_micro_steps: int) -> CrossRankSizes:
        return CrossRankSizes(job=self.slots * len(ROW)) if self.slots > 1 else NO_CROSS_RANK

    def cross_rank(self, num_micro_steps: int) -> CrossRankPayload:
        rows = np.zeros((self.slots, len(ROW)), np.float32)
        row = np.full(len(ROW), np.nan) if self._previous_row is None else self._previous_row.copy()
        row[0] = self._compute_seconds()
        rows[self.slot] = row
        return CrossRankPayload(job=rows.reshape(-1))

    def receive_cross_rank(self, summed: CrossRankPayload) -> None:
        self._rows = summed.job.reshape(self.slots, len(ROW))

    def _compute_seconds(self) -> float:
        begin, reduce = self._events.get(StepBegin), self._events.get(ReduceBegin)
        return reduce.at - begin.at if begin is not None and reduce is not None else float("nan")

    def collect(self, step: int) -> List[Record]:
        end = self._events.get(StepEnd)
        if end is None or StepBegin not in self._events:
            self.reset()
            return []
        phases = self._phases(end)
        rates = self._rates(phases["step"])
        records = [Record(step, None, self.rank, STEP_TIME, name, value) for name, value in phases.items()]
        records += self._micro_records(step)
        records += [Record(step, None, self.rank, THROUGHPUT, name, value) for name, value in rates.items()]
        records.append(Record(step, None, self.rank, WALL_CLOCK, "step_end", time.time()))
        records += [Record(step, None, self.rank, MEMORY, name, value) for name, value in self.memory.take().items()]
        records += self._eta(step, end)
        records += self._flop_records(step, phases["step"])
        records += self._drop(step, rates.get("samples_per_second"))
        records += self._across_ranks(step)
        self._previous_row = np.array([np.nan, phases["step"], *(phases[p] for p in PHASES),
                                       *(rates.get(r, np.nan) for r in RATES)], np.float64)
        self._last_end = end
        self.reset()
        return records

    def _phases(self, end: StepEnd) -> dict:
        events, begin = self._events, self._events[StepBegin]
        start = self._last_end.at if self._last_end is not None else begin.at
        step = end.at - start
        data = _between(self._written, begin) if self._written is not None and self._last_end is not None else 0.0
        marks = [begin] + self._micro
        forward_backward = sum(self._seconds(a, b) for a, b in zip(marks, marks[1:]))
        reduce = self._seconds(events[ReduceBegin], events[GradientsReduced]) \
            if ReduceBegin in events and GradientsReduced in events else 0.0
        update = self._seconds(events[GradientsReduced], events[UpdateDone]) \
            if GradientsReduced in events and UpdateDone in events else 0.0
        mindmon = end.monitor_seconds
        other = max(step - data - forward_backward - reduce - update - mindmon, 0.0)
        return {"step": step, "data": data, "forward_backward": forward_backward, "reduce": reduce,
                "update": update, "mindmon": mindmon, "other": other, "compute": self._compute_seconds()}

    def _micro_records(self, step: int) -> List[Record]:
        marks = [self._events[StepBegin]] + self._micro
        return [Record(step, b.micro_step, self.rank, STEP_TIME, "micro_batch", self._seconds(a, b))
                for a, b in zip(marks, marks[1:])]

    def _seconds(self, start, end) -> float:
        """A device phase's time: the device's own between the events' markers on Ascend and GPU
        (device_marks.py), else the host stamps less mindmon's time."""
        device = self.device_marks.seconds(start, end) if self.device_marks is not None else None
        return device if device is not None else _between(start, end)

    def _rates(self, seconds: float) -> dict:
        samples = sum(m.samples for m in self._micro if m.samples is not None) or None
        tokens = sum(m.tokens for m in self._micro if m.tokens is not None) or None
        if seconds <= 0 or samples is None:
            return {}
        replicas = self.data_parallel.size if self.data_parallel is not None else 1
        job_samples = self.global_batch_size or samples * replicas
        rates = {"samples_per_second": samples / seconds, "job_samples_per_second": job_samples / seconds}
        if tokens is not None:
            rates["tokens_per_second"] = tokens / seconds
            rates["job_tokens_per_second"] = tokens / samples * job_samples / seconds
        return rates

    def _drop(self, step: int, rate: Optional[float]) -> List[Record]:
        """On rank 0 (every rank's step takes the same wall time under the collective): this step's samples per
        second against the median of the steps before it, when it fell below `throughput_drop` of it."""
        if rate is None or self.rank != 0:
            return []
        median = float(np.median(self._recent_rates)) if len(self._recent_rates) >= MIN_STEPS_FOR_DROP else None
        self._recent_rates.append(rate)
        if median is None or not median > 0 or rate >= self.throughput_drop * median:
            return []
        return [Record(step, None, self.rank, THROUGHPUT_DROP, "samples_per_second", rate / median)]

    def _flop_records(self, step: int, seconds: float) -> List[Record]:
        """The step's useful and executed FLOPs, and MFU / HFU against the peak (none without one)."""
        if self.flops is None:
            return []
        counted, self._routed_now = self.flops.take_step(self._routed_now), None
        records = [Record(step, None, self.rank, FLOPS, name, float(value))
                   for name, value in (("useful", counted.useful), ("executed", counted.executed)) if value is not None]
        if self.peak is None or seconds <= 0:
            return records
        records += [Record(step, None, self.rank, MFU, name, value / seconds / self.peak)
                    for name, value in (("mfu", counted.useful), ("hfu", counted.executed)) if value is not None]
        return records + [Record(step, None, self.rank, MFU, "peak_tflops", self.peak / 1e12)]

    def _eta(self, step: int, end: StepEnd) -> List[Record]:
        """Seconds to the last step at the mean step time since the first step this process wrote."""
        if self._first_end is None:
            self._first_end = end
            return []
        if end.max_steps is None or end.step <= self._first_end.step:
            return []
        per_step = (end.at - self._first_end.at) / (end.step - self._first_end.step)
        return [Record(step, None, self.rank, ETA, "seconds", max(end.max_steps - step, 0) * per_step)]

    def _across_ranks(self, step: int) -> List[Record]:
        if self._rows is None or self.slot != 0:
            return []
        rows = self._rows
        records = summary_records(step, self.rank, [Column(None, f"{STEP_TIME}/compute")], rows[:, :1])
        if not np.isnan(rows[:, 1]).any():   # the previous step's figures: none at the first step
            columns = [Column(None, f"{STEP_TIME}/{name}") for name in ROW[1:1 + 1 + len(PHASES)]]
            columns += [Column(None, f"{THROUGHPUT}/{name}") for name in RATES]
            records += summary_records(step - 1, self.rank, columns, rows[:, 1:])
        return records + self._slow_ranks(step, rows[:, 0])

    def _slow_ranks(self, step: int, compute: np.ndarray) -> List[Record]:
        """The ranks whose computing time before the collective is over `slow_rank_factor` x the median;
        value: that ratio."""
        median = float(np.median(compute))
        if not median > 0:
            return []
        return [Record(step, None, self.rank, SLOW_RANK, f"rank {r}", float(c / median))
                for r, c in enumerate(compute) if c > self.slow_rank_factor * median]

    def close(self) -> None:
        if self.flops is not None:
            self.flops.detach()


def _world_size(layout) -> int:
    """The ranks of the job: the world, or the product of the groups' sizes (an expert-parallel group lies
    inside the data-parallel one)."""
    if layout.world_size:
        return int(layout.world_size)
    return int(np.prod([layout.size(axis) for axis in ("dp", "tp", "pp", "cp")]))
