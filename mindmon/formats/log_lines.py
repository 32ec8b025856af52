"""The training-log lines, to the character, and their readers.

Per micro-step k of step S, in order (train_state and tokens per expert):

    { "step": S, "micro_step": k }                     marker before the norm lines
    { "local_norm": <parameter name>: 0.000381 }        6 decimals
    { "micro_step": k, "local_loss": 0.123 }           at most 6 decimals, trailing zeros dropped
    {"iter": 2, "step": 1, "micro_step": 2, "block": "decoder", "layer": 1, "tpe": [[2, 4, 6, 8]]}

then for the step:

    { "step": S }                                       marker before the device_norm lines
    { "device_norm": <parameter name>: 1.234567 }
    { "step": S, "device_loss": 0.123 }
    { "step": S, "loss_scale": 32768.0, "overflow": true, "update_skipped": true, "skipped_steps": 3 }
    { "step": S, "loss_components": {"lm loss": 3.4, "load_balancing_loss": 0.010234, "mtp_1 loss": 1.02} }
    step:[    S/  MAX] max_attention_logit/<layer>: [1.5, 12.25]     4 significant digits per head
    step:[    S/  MAX] max_attention_logit/mean: 4.219                 over every head of every layer
    step:[    S/  MAX] max_attention_logit/max: 12.25

(the loss-scale line without `"loss_scale"` when the loop has no scaler). MAX is the run's step count
(`?` when the loop did not say). Non-finite values print as `nan`,
`inf`, `-inf` (`NaN`, `Infinity` in the JSON of the loss components) and read back as such. MindFormers' own LossCallback line, which mindmon reads and
never writes: `{ step:[    1/    3], loss:   4.844477, ..., lr: 1.5e-03, grad_norm:   1.19, ... }`.
"""
import datetime
import json
import re
from itertools import compress, groupby, repeat
from operator import attrgetter, eq, is_not
from typing import Dict, List, Optional

from mindmon.core.records import (DEVICE_LOSS, DEVICE_NORM, LOCAL_LOSS, LOCAL_NORM, LOSS_COMPONENT_STEP, LOSS_SCALE,
                       LOSS_SCALE_KINDS,
                       MAX_ATTENTION_LOGIT, MAX_ATTENTION_LOGIT_MAX, MAX_ATTENTION_LOGIT_MEAN, OVERFLOW, SKIPPED_STEPS,
                       TOKENS_PER_EXPERT, UPDATE_SKIPPED, ETA, MEMORY, MFU, SLOW_RANK, SPEED_KINDS, STEP_TIME, THROUGHPUT, THROUGHPUT_DROP,
                       Record)
from mindmon.formats.megatron_tpe import layer_fields

NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|NaN|inf|Infinity)"
MAX_LOGIT_SUMMARY_NAMES = {MAX_ATTENTION_LOGIT_MEAN: "mean", MAX_ATTENTION_LOGIT_MAX: "max"}

LOSS_CALLBACK_LINE = re.compile(r"\{ step:\[\s*(?P<step>\d+)/\s*\d+\], loss:\s*(?P<loss>" + NUMBER + r")"
                                r"(?:.*?, lr:\s*(?P<lr>" + NUMBER + r"))?(?:.*?, grad_norm:\s*(?P<grad>" + NUMBER
                                + r"))?")
MAX_LOGIT_LINE = re.compile(r"step:\[\s*(?P<step>\d+)/\s*(?:\d+|\?)\] " + MAX_ATTENTION_LOGIT
                            + r"/(?P<name>\S+): (?P<value>.+?)\s*$")
NORM_LINE = re.compile(r'\{ "(?P<kind>local_norm|device_norm)": (?P<name>\S+?):\s+(?P<value>' + NUMBER + r') \}')
MARKER_LINE = re.compile(r'\{ "step": (?P<step>\d+)(?:, "micro_step": (?P<micro_step>\d+))? \}\s*$')
LOCAL_LOSS_LINE = re.compile(r'\{ ?(?:"step": (?P<step>\d+), )?"micro_step": (?P<micro_step>\d+), '
                             r'"local_loss": (?P<value>' + NUMBER + r') ?\}')
DEVICE_LOSS_LINE = re.compile(r'\{ ?"step": (?P<step>\d+), "device_loss": (?P<value>' + NUMBER + r') ?\}')
TOKENS_PER_EXPERT_LINE = re.compile(r'(\{"iter": .*"tpe": .*\})\s*$')
LOSS_SCALE_LINE = re.compile(r'\{ "step": (?P<step>\d+), (?:"loss_scale": (?P<scale>' + NUMBER + r'), )?'
                             r'"overflow": (?P<overflow>true|false), "update_skipped": (?P<skipped>true|false), '
                             r'"skipped_steps": (?P<count>\d+) \}')
LOSS_COMPONENTS_LINE = re.compile(r'\{ "step": (?P<step>\d+), "loss_components": (?P<parts>\{.*\}) \}\s*$')
SPEED_LINE = re.compile(r"step:\[\s*(?P<step>\d+)/\s*(?:\d+|\?)\] step_time: (?P<step_ms>" + NUMBER
                        + r")ms \((?P<phases>[^)]*)\)(?P<rest>.*)$")
THROUGHPUT_DROP_LINE = re.compile(r"step:\[\s*(?P<step>\d+)/\s*(?:\d+|\?)\] throughput drop: samples/s at "
                                  r"(?P<ratio>" + NUMBER + r")x the median")
SLOW_RANK_LINE = re.compile(r"step:\[\s*(?P<step>\d+)/\s*(?:\d+|\?)\] slow rank: (?P<name>rank \d+) computed "
                            r"(?P<ratio>" + NUMBER + r")x the median")
# The loss-scale line's fields: record kind -> (field, the record's name).
LOSS_SCALE_FIELDS = {LOSS_SCALE: ("loss_scale", "scale"), OVERFLOW: ("overflow", "grads"),
                     UPDATE_SKIPPED: ("update_skipped", "update"), SKIPPED_STEPS: ("skipped_steps", "total")}


def loss_text(value: float) -> str:
    """A loss as a short JSON-like number: 6 decimals at most, trailing zeros dropped (0.123, 2.5)."""
    return repr(round(float(value), 6))


def _head_text(value: float) -> str:
    return f"{value:.4g}"


def step_prefix(step: int, max_steps: Optional[int]) -> str:
    return f"step:[{step:5d}/{max_steps if max_steps is not None else '?':>5}] "


def tokens_per_expert_line(record: Record) -> str:
    return json.dumps({"iter": record.iteration, "step": record.step, "micro_step": record.micro_step,
                       **layer_fields(record.name), "tpe": [record.value]})


def _norm_block(marker: str, kind: str, norms: List[Record]) -> List[str]:
    """A group marker, then one line per parameter norm (none at all without norms)."""
    if not norms:
        return []
    line = f'{{ "{kind}": %s: %.6f }}'.__mod__
    return [marker] + list(map(line, zip(map(_NAME, norms), map(_VALUE, norms))))


def _micro_step_lines(micro_step: int, norms: List[Record], losses: List[Record], tokens: List[Record]
                      ) -> List[str]:
    lines = _norm_block(f'{{ "step": {norms[0].step}, "micro_step": {micro_step} }}' if norms else "",
                        LOCAL_NORM, norms)
    lines.extend(f'{{ "micro_step": {micro_step}, "local_loss": {loss_text(r.value)} }}' for r in losses)
    lines.extend(tokens_per_expert_line(r) for r in tokens)
    return lines


_KIND, _NAME, _VALUE, _MICRO_STEP = (attrgetter(field) for field in ("kind", "name", "value", "micro_step"))


def _by_kind(records: List[Record], kinds: List[str]) -> Dict[str, List[Record]]:
    """The records of each kind, in their order: one `compress` over the records per kind (a step has a
    thousand records of a handful of kinds)."""
    return {kind: list(compress(records, map(eq, kinds, repeat(kind)))) for kind in dict.fromkeys(kinds)}


def _of_kinds(records: List[Record], kinds: List[str], wanted) -> List[Record]:
    """The records whose kind is in `wanted`, in their order."""
    return list(compress(records, map(wanted.__contains__, kinds)))


def _by_micro_step(records: List[Record]) -> Dict[int, List[Record]]:
    """The records with a micro-step, by micro-step (ascending), each in their order."""
    ordered = sorted(compress(records, map(is_not, map(_MICRO_STEP, records), repeat(None))), key=_MICRO_STEP)
    return {micro_step: list(group) for micro_step, group in groupby(ordered, key=_MICRO_STEP)}


def loss_scale_line(records: List[Record]) -> List[str]:
    """The step's loss-scale line, from its loss_scale records (none without them)."""
    values = {r.kind: r.value for r in records if r.kind in LOSS_SCALE_KINDS}
    if OVERFLOW not in values:
        return []
    fields = [f'"step": {next(r.step for r in records if r.kind == OVERFLOW)}']
    if LOSS_SCALE in values:
        fields.append(f'"loss_scale": {float(values[LOSS_SCALE])!r}')
    fields += [f'"overflow": {json.dumps(bool(values[OVERFLOW]))}',
               f'"update_skipped": {json.dumps(bool(values[UPDATE_SKIPPED]))}',
               f'"skipped_steps": {int(values[SKIPPED_STEPS])}']
    return ["{ " + ", ".join(fields) + " }"]


def loss_components_line(records: List[Record]) -> List[str]:
    """The step's loss components (their means over the step), at most 6 decimals each, by name."""
    parts = [r for r in records if r.kind == LOSS_COMPONENT_STEP]
    if not parts:
        return []
    values = json.dumps({r.name: round(float(r.value), 6) for r in parts})   # NaN, Infinity: JSON reads them back
    return [f'{{ "step": {parts[0].step}, "loss_components": {values} }}']


def read_loss_scale_line(match) -> List[tuple]:
    """(kind, name, value) of a loss-scale line's fields, in the order the monitor writes them."""
    values = {LOSS_SCALE: None if match["scale"] is None else float(match["scale"]),
              OVERFLOW: float(match["overflow"] == "true"), UPDATE_SKIPPED: float(match["skipped"] == "true"),
              SKIPPED_STEPS: float(match["count"])}
    return [(kind, LOSS_SCALE_FIELDS[kind][1], value) for kind, value in values.items() if value is not None]


SPEED_PHASES = ("data", "forward_backward", "reduce", "update", "mindmon", "other")


def speed_lines(records: List[Record], max_steps: Optional[int]) -> List[str]:
    """The step's time line (monitor.speed), in the manner of MindFormers' LossCallback line, and on rank 0
    one line per slow rank:

        step:[    3/   10] step_time: 812.4ms (data 1.2ms, forward_backward 700.1ms, reduce 90.3ms,
            update 15.0ms, mindmon 4.1ms, other 1.7ms), samples/s: 9.848, tokens/s: 1260.6, mfu: 41.20%,
            hfu: 52.73%, peak_rss: 1532.1MiB, eta: 0:00:05   (one line; mfu/hfu with monitor.speed.flops
            and a known peak)
        step:[    3/   10] slow rank: rank 2 computed 3.14x the median before the gradient collective
        step:[    6/   10] throughput drop: samples/s at 0.31x the median of the steps before
    """
    times = {r.name: r.value for r in records if r.kind == STEP_TIME and r.micro_step is None}
    if "step" not in times:
        return []
    step = next(r.step for r in records if r.kind == STEP_TIME)
    prefix = step_prefix(step, max_steps)
    phases = ", ".join(f"{name} {times[name] * 1e3:.1f}ms" for name in SPEED_PHASES if name in times)
    fields = [f"step_time: {times['step'] * 1e3:.1f}ms ({phases})"]
    values = {(r.kind, r.name): r.value for r in records if r.kind in (THROUGHPUT, MEMORY, ETA, MFU)}
    for key, label in (((THROUGHPUT, "samples_per_second"), "samples/s"), ((THROUGHPUT, "tokens_per_second"), "tokens/s")):
        if key in values:
            fields.append(f"{label}: {values[key]:.6g}")
    for name in ("mfu", "hfu"):
        if (MFU, name) in values:
            fields.append(f"{name}: {values[(MFU, name)] * 100:.2f}%")
    if (MEMORY, "peak_rss") in values:
        fields.append(f"peak_rss: {values[(MEMORY, 'peak_rss')] / 2 ** 20:.1f}MiB")
    if (ETA, "seconds") in values:
        fields.append(f"eta: {datetime.timedelta(seconds=round(values[(ETA, 'seconds')]))}")
    lines = [prefix + ", ".join(fields)]
    lines += [f"{prefix}slow rank: {r.name} computed {r.value:.2f}x the median before the gradient collective"
              for r in records if r.kind == SLOW_RANK]
    return lines + [f"{prefix}throughput drop: samples/s at {r.value:.2f}x the median of the steps before"
                    for r in records if r.kind == THROUGHPUT_DROP]


def read_speed_line(match) -> List[tuple]:
    """(kind, name, value) of a `speed_lines` time line, as rounded in the line (ms to 0.1, MiB to 0.1,
    rates to 6 digits, the ETA to the second)."""
    values = [(STEP_TIME, "step", float(match["step_ms"]) / 1e3)]
    for part in match["phases"].split(", "):
        name, ms = part.split(" ")
        values.append((STEP_TIME, name, float(ms[:-2]) / 1e3))
    for field in match["rest"].split(", ")[1:]:
        label, text = field.split(": ")
        if label in ("samples/s", "tokens/s"):
            values.append((THROUGHPUT, f"{label[:-2]}_per_second", float(text)))
        elif label in ("mfu", "hfu"):
            values.append((MFU, label, float(text[:-1]) / 100))
        elif label == "peak_rss":
            values.append((MEMORY, "peak_rss", float(text[:-3]) * 2 ** 20))
        elif label == "eta":
            hours, minutes, seconds = text.split(" ")[-1].split(":")
            days = int(text.split(" ")[0]) if "day" in text else 0
            values.append((ETA, "seconds", float(((days * 24 + int(hours)) * 60 + int(minutes)) * 60 + int(seconds))))
    return values


def _max_logit_lines(records: List[Record], max_steps: Optional[int]) -> List[str]:
    lines = []
    for record in records:
        if record.kind not in _MAX_LOGIT_KINDS:
            continue
        prefix = step_prefix(record.step, max_steps) + MAX_ATTENTION_LOGIT + "/"
        if record.kind == MAX_ATTENTION_LOGIT:
            lines.append(f"{prefix}{record.name}: [{', '.join(_head_text(v) for v in record.value)}]")
        else:
            lines.append(f"{prefix}{MAX_LOGIT_SUMMARY_NAMES[record.kind]}: {_head_text(record.value)}")
    return lines


_MAX_LOGIT_KINDS = frozenset((MAX_ATTENTION_LOGIT, *MAX_LOGIT_SUMMARY_NAMES))


def format_lines(records: List[Record], max_steps: Optional[int] = None) -> List[str]:
    """The lines of one step's records, in the documented order. Kinds without a line (micro_norm,
    the MoE summaries, the trainer's step values) are left to the other sinks."""
    kinds = list(map(_KIND, records))
    by_kind = _by_kind(records, kinds)
    per_micro_step = [_by_micro_step(by_kind.get(kind, [])) for kind in (LOCAL_NORM, LOCAL_LOSS, TOKENS_PER_EXPERT)]
    lines = []
    for micro_step in sorted(set().union(*per_micro_step)):
        lines += _micro_step_lines(micro_step, *(kind.get(micro_step, []) for kind in per_micro_step))
    device_norms = by_kind.get(DEVICE_NORM, [])
    lines += _norm_block(f'{{ "step": {device_norms[0].step} }}' if device_norms else "", DEVICE_NORM, device_norms)
    lines.extend(f'{{ "step": {r.step}, "device_loss": {loss_text(r.value)} }}' for r in by_kind.get(DEVICE_LOSS, []))
    return lines + loss_scale_line(_of_kinds(records, kinds, LOSS_SCALE_KINDS)) + \
        loss_components_line(by_kind.get(LOSS_COMPONENT_STEP, [])) + \
        _max_logit_lines(_of_kinds(records, kinds, _MAX_LOGIT_KINDS), max_steps) + \
        speed_lines(_of_kinds(records, kinds, SPEED_KINDS), max_steps)


def parse_heads(text: str) -> List[float]:
    return [float(v) for v in text.strip("[]").split(",")]


def summary_kind(name: str) -> Optional[str]:
    """The record kind of a `max_attention_logit/mean` or `/max` line, None for a layer's line."""
    return {v: k for k, v in MAX_LOGIT_SUMMARY_NAMES.items()}.get(name)
