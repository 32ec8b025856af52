"""`mindmon parse-log`: a MindFormers training log turned into mindmon's JSONL records.

Understood lines (anywhere after the logger's prefix, whichever prefix format it has):

    { step:[    1/    3], loss:   4.844477, per_step_time: ..., lr: 1.5e-03, grad_norm:   1.19, ... }
                                         MindFormers' LossCallback -> loss, learning_rate, grad_norm
                                         (and samples, when the log says `global_batch_size=N`)
    step:[    2/   10] max_attention_logit/<layer>: [1.5, 12.25]        -> max_attention_logit
    { "step": 4, "micro_step": 2 }       mindmon's group marker: step and micro-step of the norms below
    { "local_norm": <param>: 0.000381 }  (upstream pads the value: `<param>:   1.500000`)
    { "micro_step": 2, "local_loss": 0.123 }    {"step": 3, "micro_step": 1, "local_loss": 2.5}
    { "step": 4 }                        marker before the device_norm lines
    { "device_norm": <param>: 0.001234 }
    { "step": 4, "device_loss": 0.123 }
    {"iter": 2, "step": 1, "micro_step": 2, "block": "decoder", "layer": 1, "tpe": [[2, 4, 6, 8]]}

Any other line is counted and skipped. Example:
    parser = LogParser(rank=0)
    records = [r for line in open("info.log") for r in parser.feed(line)]
"""
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from .records import (DEVICE_LOSS, DEVICE_NORM, GRAD_NORM, LEARNING_RATE, LOCAL_LOSS, LOCAL_NORM, LOSS,
                      MAX_ATTENTION_LOGIT, SAMPLES, TOKENS_PER_EXPERT, Record)
from .sinks.jsonl import JsonlSink

_NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|NaN|inf|-inf)"
LOSS_LINE = re.compile(r"\{ step:\[\s*(?P<step>\d+)/\s*\d+\], loss:\s*(?P<loss>" + _NUMBER + r")"
                       r"(?:.*?, lr:\s*(?P<lr>" + _NUMBER + r"))?(?:.*?, grad_norm:\s*(?P<grad>" + _NUMBER + r"))?")
MAX_LOGIT_LINE = re.compile(r"step:\[\s*(?P<step>\d+)/\s*\d+\] " + MAX_ATTENTION_LOGIT
                            + r"/(?P<name>\S+): (?P<value>.+?)\s*$")
NORM_LINE = re.compile(r'\{\s*"(?P<kind>local_norm|device_norm)":\s*(?P<name>\S+?):\s*(?P<value>' + _NUMBER
                       + r')\s*\}')
JSON_LINE = re.compile(r'(\{\s*".*\})\s*$')
BATCH_LINE = re.compile(r"global_batch_size=(?P<gbs>\d+), num_accumulation_steps=\d+")
# A line that mentions a monitor key but matched no format above: cut short, or a format this
# version does not know. Counted apart from the log's other lines.
MONITOR_HINT = re.compile(r'\{.*"(?:local_norm|device_norm|local_loss|device_loss|tpe)"|' + MAX_ATTENTION_LOGIT
                          + r"/|\{ step:\[")
RANK_IN_PATH = re.compile(r"(?:rank_|worker_)(\d+)")
MAX_LOGIT_SUMMARIES = ("mean", "max")   # derived from the per-layer lines: not records


def layer_name(fields: dict) -> str:
    """`decoder.layers.<layer>` or `mtp.layers.<mtp_idx>`: the record name of a tokens-per-expert line."""
    if fields.get("block") == "mtp":
        return f"mtp.layers.{fields.get('mtp_idx', 0)}"
    return f"{fields.get('block', 'decoder')}.layers.{fields['layer']}"


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
        for pattern, handler in ((LOSS_LINE, self._loss_callback), (MAX_LOGIT_LINE, self._max_logit),
                                 (NORM_LINE, self._norm), (JSON_LINE, self._json), (BATCH_LINE, self._batch)):
            match = pattern.search(line)
            if match:
                return handler(match)
        if MONITOR_HINT.search(line):
            raise ValueError("a monitor line in no known format")
        self.counts.other += 1
        return None

    def _record(self, kind: str, name: str, value, step: Optional[int] = None, micro_step: Optional[int] = None,
                **extra) -> Record:
        return Record(self.step if step is None else step, micro_step, self.rank, kind, name, value, **extra)

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

    def _max_logit(self, match) -> List[Record]:
        self._enter_step(int(match["step"]))
        if match["name"] in MAX_LOGIT_SUMMARIES:
            return []
        heads = [float(v) for v in match["value"].strip("[]").split(",")]
        return [self._record(MAX_ATTENTION_LOGIT, match["name"], heads)]

    def _norm(self, match) -> List[Record]:
        micro_step = self.micro_step if match["kind"] == LOCAL_NORM else None
        if match["kind"] == LOCAL_NORM and micro_step is None:
            raise ValueError("local_norm line before any micro-step marker")
        kind = LOCAL_NORM if match["kind"] == LOCAL_NORM else DEVICE_NORM
        return [self._record(kind, match["name"], float(match["value"]), micro_step=micro_step)]

    def _batch(self, match) -> List[Record]:
        self.global_batch_size = int(match["gbs"])
        return []

    def _json(self, match) -> Optional[List[Record]]:
        data = json.loads(match.group(1))
        keys = set(data)
        if "tpe" in data:
            return self._tokens_per_expert(data)
        if LOCAL_LOSS in data:
            return [self._local_loss(data)]
        if DEVICE_LOSS in data:
            self._enter_step(int(data["step"]))
            return [self._record(DEVICE_LOSS, "loss", float(data[DEVICE_LOSS]))]
        if keys == {"step", "micro_step"}:
            self._enter_step(int(data["step"]), int(data["micro_step"]))
            return []
        if keys == {"step"}:
            self._enter_step(int(data["step"]))
            return []
        raise ValueError(f"JSON line with unknown keys {sorted(keys)}")

    def _local_loss(self, data: dict) -> Record:
        micro_step = int(data["micro_step"])
        if "step" in data:
            self._enter_step(int(data["step"]), micro_step)
        elif self._last_local_loss is not None and micro_step <= self._last_local_loss:
            self._enter_step(self.step + 1, micro_step)   # no marker between two steps' loss lines
        self._last_local_loss = micro_step
        return self._record(LOCAL_LOSS, "loss", float(data[LOCAL_LOSS]), micro_step=micro_step)

    def _tokens_per_expert(self, data: dict) -> List[Record]:
        name = layer_name(data)
        if "step" in data and "micro_step" in data:   # upstream: one micro-batch per line
            self._enter_step(int(data["step"]))
            extra = {"iteration": int(data["iter"])} if "iter" in data else {}
            return [self._record(TOKENS_PER_EXPERT, name, list(tpe), micro_step=int(data["micro_step"]), **extra)
                    for tpe in data["tpe"]]
        # Megatron: `iter` is the step, one inner list per micro-batch.
        self._enter_step(int(data["iter"]))
        return [self._record(TOKENS_PER_EXPERT, name, list(tpe), micro_step=k) for k, tpe in enumerate(data["tpe"])]


def rank_of(path: str) -> int:
    """The rank a log belongs to, from a `rank_<r>` or `worker_<r>` in its path; 0 otherwise."""
    matches = RANK_IN_PATH.findall(os.path.abspath(path))
    return int(matches[-1]) if matches else 0


def parse_log(log_path: str, output_dir: str, rank: Optional[int] = None, progress=sys.stderr,
              every: int = 100_000) -> Counts:
    """Writes `<output_dir>/rank_<r>/metrics.jsonl` from the log; returns what was counted."""
    parser = LogParser(rank_of(log_path) if rank is None else rank)
    sink = JsonlSink(output_dir, parser.rank)
    try:
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            pending = []
            for line in handle:
                pending += parser.feed(line)
                if parser.counts.lines % every == 0:   # one write (and flush) per block of lines
                    sink.write(pending)
                    pending = []
                    if progress is not None:
                        print(f"mindmon parse-log: {parser.counts.lines} lines, {parser.counts.records} records",
                              file=progress, flush=True)
            sink.write(pending)
    finally:
        sink.close()
    return parser.counts
