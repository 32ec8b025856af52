"""AlertSink: judges every record it is given with the configured rules, logs each anomaly,
dumps it (`dump: true`) and hands it to the delivery threads (`inform`). Its cost in the step is
a few dict look-ups per record; nothing in it waits for a network.

Example:
    sink = AlertSink(AlertConfig.parse("monitor.alert", section), "./output/monitor", rank=0)
    sink.open(RunInfo(rank=0))
    sink.write(records)    # records of one step, any kind
    sink.flush()           # the dump: this step's anomalies appended, the file whole at every instant
    sink.close()           # waits for delivery (at most close_timeout) and logs what was delivered

Run events (started, finished, crashed, rank_lost, hang, slow_rank) reach the recipients whose
`events` name them through `report_event` and its named helpers (`run_started`, `run_finished`,
`run_crashed`, `rank_lost`, `hang`, `slow_rank`); see mindmon.features.alerts.lifecycle.
"""
import logging
import os
import sys
import threading
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mindmon.parallel.chunks import has_chunk, split_chunk
from mindmon.core.engine import RunInfo, Sink
from mindmon.core.records import SLOW_RANK, THROUGHPUT_DROP, Record, TensorStatsRecord
from mindmon.features.alerts.actions import AlertActions
from mindmon.features.alerts.anomaly import Anomaly
from mindmon.features.alerts.config import AlertConfig
from mindmon.features.alerts.buffer import SPOOL_DIR
from mindmon.features.alerts.delivery import Deliverer, DeliveryReport
from mindmon.features.alerts.dump import AnomalyDump, rank_folder, run_id_of
from mindmon.features.alerts.inform import EVENT_KINDS, recipient_id
from mindmon.features.alerts import lifecycle
from mindmon.features.alerts.recipients import build_recipient
from mindmon.features.alerts.rules import (NOT_JUDGED, Verdict, first_verdict, msprobe_tag_and_statistic, scalar_value,
                                           tag_and_statistic)

LOGGED_PER_WRITE = 20  # anomaly lines per step in the log; the rest are summarised in one line


def _scalars(records: Sequence[Record]):
    """Records as the rules read them: a tensor's statistics one by one (`<tensor>/<op>`)."""
    for record in records:
        if isinstance(record, TensorStatsRecord):
            yield from record.per_statistic()
        else:
            yield record


class AlertSink(Sink):
    def __init__(self, config: AlertConfig, output_dir: str, rank: int = 0,
                 logger: Optional[logging.Logger] = None, group_mates: Optional[Sequence[int]] = None,
                 pp_stage: int = 0, vpp_stage: int = 0, actions: Optional[AlertActions] = None,
                 statistic_of: Callable[[Record], Tuple[str, str]] = tag_and_statistic,
                 path: str = "monitor.alert", monitored: Sequence[str] = (), world_size: int = 1):
        self.config = config
        self.monitored, self.world_size = list(monitored), world_size
        self._previous_hook = None          # sys.excepthook before open() chained ours in front of it
        self._told: set = set()             # the run's started / finished / crashed, once each
        self._max_steps: Optional[int] = None
        self.rank = rank
        self.logger = logger or logging.getLogger("mindmon")
        self.group_mates = list(group_mates) if group_mates is not None else None
        self.stages = (pp_stage, vpp_stage)
        self.actions = actions
        self.statistic_of = statistic_of
        self.rules = config.build_rules()
        self.dump = AnomalyDump(output_dir, rank) if config.dump else None
        paths = [f"{path}.inform"] if len(config.inform) == 1 else \
            [f"{path}.inform[{i}]" for i in range(len(config.inform))]
        self.output_dir = output_dir
        self.recipients = [build_recipient(inform, p) for inform, p in zip(config.inform, paths)]  # ConfigError now
        self.deliverers: List[Deliverer] = []
        self.run_id: Optional[str] = None
        self.count = 0                       # anomalies found so far
        self.events = 0                      # run events reported so far
        self.recent: deque = deque(maxlen=100)
        self.reports: List[DeliveryReport] = []
        self._calls = 0
        self._dump_failed = False
        self._series = {}                    # (kind, name) -> (tag, statistic, the rules that read it, series key)
        self._step = 0                       # the last step a record was written for (events default to it)
        self._lock = threading.Lock()        # events come from other threads (the watchdog's)
        self._closed = False

    def open(self, run: RunInfo) -> None:
        self.rank = run.rank
        self._step = run.start_step
        if self.dump is not None:
            self.dump.set_rank(run.rank)
            if run.resumed:
                self.dump.load_existing()
        self._start_delivery(run.resumed)
        self._max_steps = run.max_steps
        self._previous_hook, sys.excepthook = sys.excepthook, self._excepthook

    def _wanted(self, kind: str) -> bool:
        """A recipient is told of this run event (the sink says the run's own ones only then)."""
        return any(kind in inform.events for inform in self.config.inform)

    def _excepthook(self, kind, error, traceback) -> None:
        """An exception nobody caught ends the run: the crash goes to the recipients (within their
        close_timeout) before Python prints it."""
        try:
            if not self._closed and "crashed" not in self._told:
                self.run_crashed(error)
                self.close()
        finally:
            (self._previous_hook or sys.__excepthook__)(kind, error, traceback)

    def _start_delivery(self, resumed: bool = False) -> None:
        """The delivery threads, once the rank (the spool's folder) is known; a sink used without
        `open` starts them at its first anomaly."""
        if self.run_id is not None or not self.recipients:
            return
        self.run_id = run_id_of(self.output_dir, self.rank, resumed)
        folder = os.path.join(rank_folder(self.output_dir, self.rank), SPOOL_DIR)
        self.deliverers = [Deliverer(recipient, self.logger, os.path.join(folder, f"{recipient_id(recipient.inform)}.jsonl"),
                                     self.run_id) for recipient in self.recipients]

    def write(self, records: Sequence[Record]) -> None:
        found = []
        for record in _scalars(records):
            self._calls += 1
            x = scalar_value(record.value)
            if x is None:
                continue
            tag, statistic, rules, series = self._series_of(record)
            verdict = first_verdict(rules, series, x) if rules else None
            if verdict is not None:
                found.append(self._anomaly(record, tag, statistic, x, verdict))
        if records:
            self._step = max(self._step, records[-1].step)
            if self.rank == 0 and "started" not in self._told and self._wanted("started"):
                self.run_started(self.monitored, world_size=self.world_size, max_steps=self._max_steps)
        if found:
            self._handle(found)
        for record in records:   # rank 0's speed monitor finds them (monitor.speed)
            if record.kind == THROUGHPUT_DROP:
                self.report_event("throughput_drop", step=record.step, value=record.value,
                                  message=f"throughput at step {record.step} fell to {record.value:.2f}x the median of "
                                          f"the steps before it", details={"over_median": round(float(record.value), 6)})
            if record.kind == SLOW_RANK:
                self.report_event("slow_rank", rank=int(record.name.split()[-1]), step=record.step, value=record.value,
                                  message=f"rank {record.name.split()[-1]} computed {record.value:.2f}x the median "
                                          f"before the gradient collective at step {record.step}",
                                  details={"compute_over_median": round(float(record.value), 6)})

    def _series_of(self, record: Record) -> tuple:
        """Worked out once per (kind, name, micro-step): `statistic_of` depends on nothing else. A series is
        one tag's statistic: in msprobe's spelling a per-micro-step value's tag holds its micro-step, so
        each micro-step has its own history, as in msprobe."""
        key = (record.kind, record.name, record.micro_step)
        if key not in self._series:
            tag, statistic = self.statistic_of(record)
            rules = [rule for rule in self.rules if rule.selects(record.kind, statistic)
                     and statistic not in NOT_JUDGED]
            self._series[key] = (tag, statistic, rules, (record.kind, tag, statistic))
        return self._series[key]

    def _anomaly(self, record: Record, tag: str, statistic: str, x: float, verdict: Verdict) -> Anomaly:
        step = record.step - 1 + self.config.first_step   # records count from 1; msprobe's dump from 0
        where = f"step {step}" + ("" if record.micro_step is None else f", micro-step {record.micro_step}")
        message = (f"Rule {verdict.rule_name} reports anomaly signal in ('{tag}', '{statistic}') at {where} "
                   f"on rank {record.rank}: {verdict.detail}.")
        mates = self.group_mates if self.group_mates is not None else [record.rank]
        pp_stage, vpp_stage = self.stages
        if has_chunk(record.name):   # a virtual pipeline's chunk (mindmon.parallel.chunks)
            vpp_stage = split_chunk(record.name)[0]
        return Anomaly(record.rank, step, record.micro_step, self._calls, record.kind, record.name, tag,
                       statistic, x, verdict.rule_name, message, pp_stage, vpp_stage, group_mates=mates)

    def report_event(self, kind: str, rank: Optional[int] = None, step: Optional[int] = None,
                     value: Optional[float] = None, message: Optional[str] = None, statistic: Optional[str] = None,
                     details: Optional[Dict[str, Any]] = None) -> Anomaly:
        """A run event judged outside the rules, handed to every recipient whose `events` names `kind`
        (one of `started, finished, crashed, rank_lost, hang, slow_rank`) and, for the kinds that say
        something went wrong, dumped. Its tag, name and rule are `kind`; `step` counts as the records do
        (1 = the first step; default: the last step written, 0 before the first); `value` and
        `statistic` default by kind (lifecycle.STATISTICS); `message` defaults to a line made from
        `details` (JSON values), which also reach each recipient in full. Not logged: whoever judged it
        logged it. Safe from another thread; after `close` it reaches no recipient (logged once)."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"event kind {kind!r}; allowed: {list(EVENT_KINDS)}")
        rank = self.rank if rank is None else int(rank)
        step = self._step if step is None else int(step)
        shown = step - 1 + self.config.first_step if step >= 1 else 0   # records count from 1; msprobe's dump from 0
        details = {"at": lifecycle.now_text(), **(details or {})}
        if message is None:
            message = lifecycle.event_message(kind, rank, shown, details)
        event = Anomaly(rank, shown, None, self._calls, kind, kind, kind, statistic or lifecycle.STATISTICS[kind],
                        float(step if value is None else value), kind, message, *self.stages,
                        group_mates=self.group_mates if self.group_mates is not None else [rank], details=details)
        if self._closed:
            self.logger.warning("mindmon alerts: the %s event came after the alerts closed and reaches no recipient: "
                                "%s", kind, message)
            return event
        self._handle([event], log=False)
        return event

    def run_started(self, monitored: Sequence[str] = (), layout: Optional[str] = None,
                    hosts: Optional[Sequence[str]] = None, world_size: Optional[int] = None,
                    max_steps: Optional[int] = None) -> Anomaly:
        """Once at the start (rank 0, or every rank: one row each): what is monitored (feature names),
        the parallel layout (e.g. "dp 2 x tp 2"), the hosts (this one when not given), the versions."""
        self._told.add("started")
        details = lifecycle.started_details(monitored, layout, hosts, world_size, max_steps, self.output_dir)
        return self.report_event("started", step=0, value=details.get("world_size", 1), details=details)

    def run_finished(self, steps: Optional[int] = None, reason: str = "completed") -> Anomaly:
        """At the normal end, before `close` (which delivers it): the steps run and why it ended
        ("completed", "stopped on an anomaly", "max_steps reached", ...)."""
        self._told.add("finished")
        step = self._step if steps is None else steps
        return self.report_event("finished", step=step, value=step, details={"steps": step, "reason": reason})

    def run_crashed(self, error: BaseException, step: Optional[int] = None) -> Anomaly:
        """From the front door's `except` around training, before `close`: the exception's last line."""
        self._told.add("crashed")
        return self.report_event("crashed", step=step, details={"exception": lifecycle.exception_line(error),
                                                                "type": type(error).__name__})

    def rank_lost(self, lost_ranks: Sequence[int], message: str, step: Optional[int] = None) -> Anomaly:
        """The peer watchdog's finding on rank 0: the ranks that stopped answering and its line."""
        lost = sorted(int(r) for r in lost_ranks)
        return self.report_event("rank_lost", rank=lost[0] if lost else None, step=step, value=len(lost),
                                 message=message, details={"lost_ranks": lost, "finding": message})

    def hang(self, hang: Any) -> Anomaly:
        """The peer watchdog's `Hang` (its `on_hang`): the first odd rank, the majority's step, the
        seconds without progress, its line; the whole finding in details."""
        return self.report_event("hang", rank=hang.odd[0] if hang.odd else 0, step=hang.step, value=hang.stalled,
                                 message=hang.line, details=lifecycle.hang_details(hang))

    def slow_rank(self, rank: int, step: int, seconds: float, median_seconds: float, message: Optional[str] = None,
                  phase: Optional[str] = None) -> Anomaly:
        """A rank whose step (or `phase` of it) took `seconds` against the ranks' median."""
        details = {"seconds": round(float(seconds), 6), "median_seconds": round(float(median_seconds), 6)}
        if phase is not None:
            details["phase"] = phase
        return self.report_event("slow_rank", rank=rank, step=step, value=seconds, message=message, details=details)

    def _handle(self, found: List[Anomaly], log: bool = True) -> None:
        with self._lock:
            self._take(found, log)

    def _take(self, found: List[Anomaly], log: bool) -> None:
        events = [a for a in found if a.is_event]
        self.count += len(found) - len(events)
        self.events += len(events)
        self.recent.extend(found)
        for anomaly in found[:LOGGED_PER_WRITE] if log else ():
            self.logger.warning("mindmon alert: %s", anomaly.message)
        if log and len(found) > LOGGED_PER_WRITE:
            self.logger.warning("mindmon alert: %d more anomalies at step %d (see the dump)",
                                len(found) - LOGGED_PER_WRITE, found[-1].step)
        dumped = [a for a in found if not a.is_event or a.kind in lifecycle.DUMPED] if events else found
        if self.dump is not None and dumped:
            self.dump.add(dumped)
        self._start_delivery()
        for deliverer in self.deliverers:
            wanted = [a for a in found if deliverer.wants(a)] if events else found
            if wanted:
                deliverer.submit(wanted)
        if self.actions is not None and len(events) < len(found):
            self.actions.note([a for a in found if not a.is_event])

    def flush(self) -> None:
        """Writes the dump; a failure (disk full) is logged once and retried at the next flush,
        the file on disk stays the last complete one."""
        if self.dump is None:
            return
        try:
            with self._lock:
                self.dump.write()
        except OSError as error:
            if not self._dump_failed:
                self.logger.error("mindmon alerts: writing %s failed (%s); retrying at every step end, "
                                  "training goes on", self.dump.path, error)
            self._dump_failed = True

    def close(self) -> None:
        """The run's end (crashed when an exception is on its way: a `finally` or `except` around training;
        else finished, told by rank 0), writes the dump, then waits (at most `close_timeout` each) for
        delivery and logs the counts."""
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook or sys.__excepthook__
        if not self._closed and not self._told & {"crashed", "finished"}:
            error = sys.exc_info()[1]
            if error is not None:
                self.run_crashed(error)
            elif self.rank == 0 and self._wanted("finished"):
                self.run_finished()
        try:
            self.flush()
            if self.dump is not None and not self.dump.pending:
                self.dump.finish()
        finally:
            with self._lock:
                self._closed = True
            self._start_delivery()
            for deliverer in self.deliverers:   # every recipient's close_timeout runs at the same time
                deliverer.start_closing()
            self.reports = [deliverer.close() for deliverer in self.deliverers]
            self.deliverers = []


def build_alert_sink(config: AlertConfig, output_dir: str, rank: int = 0, logger: Optional[logging.Logger] = None,
                     data_parallel=None, path: str = "monitor.alert", pipeline=None,
                     monitored: Sequence[str] = ()) -> Tuple[AlertSink, AlertActions]:
    """The sink and the actions object for one rank, as a trainer wires them: `group_mates` are the
    data-parallel ranks, the actions agree over the same group. With `pipeline` (the pipeline group, a
    `DataParallel`; msprobe's `process_group`) the anomalies carry this rank's stage in it as `pp_stage`
    and its ranks as `group_mates`, as msprobe's dump does. Raises ConfigError (a missing database
    driver) before training starts."""
    size = data_parallel.size if data_parallel is not None else 1
    mates = list(range(size)) if size > 1 else [rank]
    pp_stage = 0
    if pipeline is not None and pipeline.size > 1:
        pp_stage, mates = pipeline.rank, list(pipeline.world_ranks())
    actions = AlertActions.from_config(config, data_parallel, logger)
    spelling = msprobe_tag_and_statistic if config.dialect == "msprobe" else tag_and_statistic
    return AlertSink(config, output_dir, rank, logger, group_mates=mates, pp_stage=pp_stage, actions=actions,
                     statistic_of=spelling, path=path, monitored=monitored, world_size=_world_size()), actions


def _world_size() -> int:
    from mindmon.parallel.data_parallel import DataParallel

    return DataParallel().size


def delivery_note(sink: AlertSink, rows: int = 10) -> List[str]:
    """Lines for a closing note, after `sink.close()`: each recipient's counts and, for databases,
    the last rows selected back (so the note shows what really arrived). Passwords masked."""
    from mindmon.features.alerts.inform import DatabaseInform
    from mindmon.features.alerts.recipients import read_back_rows

    lines = [f"alerts: {sink.count} anomalies"]
    for inform, report in zip(sink.config.inform, sink.reports):
        lines.append(f"  {report.summary()}")
        if isinstance(inform, DatabaseInform) and report.delivered:
            try:
                selected = read_back_rows(inform.url, inform.table, rows)
            except Exception as error:  # the note must not fail the run's end
                lines.append(f"    (reading back failed: {type(error).__name__})")
                continue
            lines += [f"    id {r['id']}: step {r['step']} {r['tag_name']} {r['statistic']}={r['value_text']} "
                      f"({r['rule_name']})" for r in selected]
    return lines
