"""`mindmon parse-log`: a MindFormers training log turned into mindmon's JSONL records.

Understood lines (anywhere after the logger's prefix, whichever prefix format it has) are those of
mindmon.formats.log_lines: MindFormers' LossCallback line (-> loss, learning_rate, grad_norm, and
samples when the log says `global_batch_size=N`), mindmon's train_state markers and values, the
loss-scale and loss-components lines, tokens per expert (upstream's per-micro-step line and
Megatron's per-step line), and the max attention logit per layer with its mean and max. Upstream's variants (a padded norm value, a
`local_loss` line carrying its step) are read too. Any other line is counted and skipped.

Example:
    parser = LogParser(rank=0)
    records = [r for line in open("info.log") for r in parser.feed(line)]
"""
import json
import re
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from mindmon.core.engine import RunInfo
from mindmon.formats import log_lines, megatron_tpe, training_state_log
from mindmon.formats.run_folder import rank_in_path
from mindmon.core.records import (SLOW_RANK, THROUGHPUT_DROP, DEVICE_LOSS, DEVICE_NORM, GRAD_NORM, LEARNING_RATE, LOCAL_LOSS, LOCAL_NORM, LOSS,
                       LOSS_COMPONENT_STEP, MAX_ATTENTION_LOGIT, SAMPLES, TOKENS_PER_EXPERT, Record)
from mindmon.sinks.jsonl import JsonlSink

BATCH_LINE = re.compile(r"global_batch_size=(?P<gbs>\d+), num_accumulation_steps=\d+")
# A line that mentions a monitor key but matched no format: cut short, or a format this version
# does not know. Counted apart from the log's other lines.
MONITOR_HINT = re.compile(r'\{.*"(?:local_norm|device_norm|local_loss|device_loss|tpe|update_skipped|'
                          r'loss_components)"|' + MAX_ATTENTION_LOGIT + r"/|\{ step:\[")
WORKER_IN_PATH = re.compile(r"worker_(\d+)")


@dataclass
class Counts:
    lines: int = 0
    records: int = 0
    other: int = 0          # lines with no monitor data (config dumps, warnings, ...)
    malformed: int = 0      # lines that look like monitor lines but do not parse
    first_malformed: List[str] = field(default_factory=list)


class LogParser:
    """Reads a log line by line, keeping the step/micro-step context that mindmon's markers give.

    Lines without their own step take the last step seen (a marker, LossCallback, max logit or a
    loss line); a `local_loss` micro-step that does not move forward starts the next step. A
    `local_norm` line takes the step and micro-step of the last marker or `local_loss` line that
    carries them; one before any such line cannot be placed and is counted as unreadable.
    """

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.counts = Counts()
        self.global_batch_size: Optional[int] = None
        self.step = 0
        self.micro_step: Optional[int] = None
        self._last_local_loss: Optional[int] = None
        self._training_state_lines = training_state_log.LineReader(rank)
        self._handlers = ((log_lines.LOSS_CALLBACK_LINE, self._loss_callback),
                          (training_state_log.LINE, self._training_state),
                          (log_lines.MAX_LOGIT_LINE, self._max_logit), (log_lines.NORM_LINE, self._norm),
                          (log_lines.MARKER_LINE, self._marker), (log_lines.LOCAL_LOSS_LINE, self._local_loss),
                          (log_lines.DEVICE_LOSS_LINE, self._device_loss),
                          (log_lines.LOSS_SCALE_LINE, self._loss_scale),
                          (log_lines.LOSS_COMPONENTS_LINE, self._loss_components),
                          (log_lines.SPEED_LINE, self._speed), (log_lines.SLOW_RANK_LINE, self._slow_rank),
                          (log_lines.THROUGHPUT_DROP_LINE, self._throughput_drop),
                          (log_lines.TOKENS_PER_EXPERT_LINE, self._tokens_per_expert), (BATCH_LINE, self._batch))

    def feed(self, line: str) -> List[Record]:
        self.counts.lines += 1
        try:
            records = self._parse(line.rstrip("\n"))
        except (ValueError, KeyError, TypeError, IndexError):
            records = None
            self.counts.malformed += 1
            if len(self.counts.first_malformed) < 3:
                self.counts.first_malformed.append(line.strip()[:200])
        if records is not None:
            self.counts.records += len(records)
        return records or []

    def _parse(self, line: str) -> Optional[List[Record]]:
        """The line's records; None for a line with no monitor data."""
        for pattern, handler in self._handlers:
            match = pattern.search(line)
            if match:
                return handler(match)
        if MONITOR_HINT.search(line):
            raise ValueError("a monitor line in no known format")
        self.counts.other += 1
        return None

    def _record(self, kind: str, name: str, value, micro_step: Optional[int] = None, **extra) -> Record:
        return Record(self.step, micro_step, self.rank, kind, name, value, **extra)

    def _enter_step(self, step: int, micro_step: Optional[int] = None) -> None:
        if step != self.step:
            self._last_local_loss = None
        self.step, self.micro_step = step, micro_step

    def _loss_callback(self, match) -> List[Record]:
        self._enter_step(int(match["step"]))
        out = [self._record(LOSS, "loss", float(match["loss"]))]
        if match["lr"] is not None:
            out.append(self._record(LEARNING_RATE, "lr", float(match["lr"])))
        if match["grad"] is not None and match["grad"] != "NaN":   # "NaN" = the trainer passed no norm
            out.append(self._record(GRAD_NORM, "global", float(match["grad"])))
        if self.global_batch_size:
            out.append(self._record(SAMPLES, "consumed", float(self.step * self.global_batch_size)))
        return out

    def _training_state(self, match) -> Optional[List[Record]]:
        """MindFormers' TrainingStateMonitor line (monitor_config); its max-logit lines go to `_max_logit`."""
        if match["tag"].startswith(MAX_ATTENTION_LOGIT + "/"):
            return self._max_logit(log_lines.MAX_LOGIT_LINE.search(match.string))
        self._enter_step(int(match["step"]))
        return self._training_state_lines.read(match.string) or None

    def _max_logit(self, match) -> List[Record]:
        self._enter_step(int(match["step"]))
        summary = log_lines.summary_kind(match["name"])
        if summary is not None:
            return [self._record(summary, "all", float(match["value"]))]
        return [self._record(MAX_ATTENTION_LOGIT, match["name"], log_lines.parse_heads(match["value"]))]

    def _norm(self, match) -> List[Record]:
        if match["kind"] == LOCAL_NORM:
            if self.micro_step is None:
                raise ValueError("local_norm line before any micro-step marker")
            return [self._record(LOCAL_NORM, match["name"], float(match["value"]), self.micro_step)]
        return [self._record(DEVICE_NORM, match["name"], float(match["value"]))]

    def _marker(self, match) -> List[Record]:
        micro_step = match["micro_step"]
        self._enter_step(int(match["step"]), None if micro_step is None else int(micro_step))
        return []

    def _batch(self, match) -> List[Record]:
        self.global_batch_size = int(match["gbs"])
        return []

    def _device_loss(self, match) -> List[Record]:
        self._enter_step(int(match["step"]))
        return [self._record(DEVICE_LOSS, "loss", float(match["value"]))]

    def _loss_scale(self, match) -> List[Record]:
        self._enter_step(int(match["step"]))
        return [self._record(kind, name, value) for kind, name, value in log_lines.read_loss_scale_line(match)]

    def _loss_components(self, match) -> List[Record]:
        self._enter_step(int(match["step"]))
        parts = json.loads(match["parts"])
        return [self._record(LOSS_COMPONENT_STEP, name, float(value)) for name, value in parts.items()]

    def _speed(self, match) -> List[Record]:
        self._enter_step(int(match["step"]))
        return [self._record(kind, name, value) for kind, name, value in log_lines.read_speed_line(match)]

    def _throughput_drop(self, match) -> List[Record]:
        self._enter_step(int(match["step"]))
        return [self._record(THROUGHPUT_DROP, "samples_per_second", float(match["ratio"]))]

    def _slow_rank(self, match) -> List[Record]:
        self._enter_step(int(match["step"]))
        return [self._record(SLOW_RANK, match["name"], float(match["ratio"]))]

    def _local_loss(self, match) -> List[Record]:
        micro_step = int(match["micro_step"])
        if match["step"] is not None:
            self._enter_step(int(match["step"]), micro_step)
        elif self._last_local_loss is not None and micro_step <= self._last_local_loss:
            self._enter_step(self.step + 1, micro_step)   # no marker between two steps' loss lines
        self._last_local_loss = micro_step
        self.micro_step = micro_step
        return [self._record(LOCAL_LOSS, "loss", float(match["value"]), micro_step)]

    def _tokens_per_expert(self, match) -> List[Record]:
        data = json.loads(match.group(1))
        if "step" in data and "micro_step" in data:   # upstream: one micro-batch per line
            self._enter_step(int(data["step"]))
            extra = {"iteration": int(data["iter"])} if "iter" in data else {}
            name = megatron_tpe.layer_name(data)
            return [self._record(TOKENS_PER_EXPERT, name, list(tpe), int(data["micro_step"]), **extra)
                    for tpe in data["tpe"]]
        self._enter_step(int(data["iter"]))           # Megatron: `iter` is the step
        return megatron_tpe.decode(data, self.rank)


def rank_of(path: str) -> int:
    """The rank a log belongs to, from a `rank_<r>` or `worker_<r>` in its path; 0 otherwise."""
    rank = rank_in_path(path)
    if rank is not None:
        return rank
    workers = WORKER_IN_PATH.findall(path)
    return int(workers[-1]) if workers else 0


def parse_log(log_path: str, output_dir: str, rank: Optional[int] = None, progress=sys.stderr,
              every: int = 100_000) -> Counts:
    """Writes `<output_dir>/rank_<r>/metrics.jsonl` from the log; returns what was counted."""
    parser = LogParser(rank_of(log_path) if rank is None else rank)
    sink = JsonlSink(output_dir)
    sink.open(RunInfo(parser.rank))
    try:
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            pending = []
            for line in handle:
                pending += parser.feed(line)
                if parser.counts.lines % every == 0:   # one write (and flush) per block of lines
                    sink.write(pending)
                    sink.flush()
                    pending = []
                    if progress is not None:
                        print(f"mindmon parse-log: {parser.counts.lines} lines, {parser.counts.records} records",
                              file=progress, flush=True)
            sink.write(pending)
    finally:
        sink.close()
    return parser.counts
