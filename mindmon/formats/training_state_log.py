"""MindFormers' TrainingStateMonitor log line, written and read: one value per line,

    Epoch:[  1/  1], step:[    3/   20] <tag>: <value>

with MindFormers' tags (`local_norm/<parameter>`, `micro_local_lm_loss`, `device_accum_local_lm_loss`,
`device_local_norm`, `adam_m_norm/<parameter>`, `adam_v_norm/<parameter>`, `weight_norm`,
`throughput_linearity`, `weight_stable_rank/<parameter>[/expert_<e>|/expert_max|...]`,
`weight_eigenvalue/...`, `max_attention_logit/<layer>` with a per-head list, `max_attention_logit/mean`,
`max_attention_logit/max`). The PyNative trainer has no epochs: the epoch is always `1/  1` and MAX is
the run's step count (`?` when the loop did not say). Values print as Python floats (they read back
exactly); lists as `[a, b, ...]`. Per-micro-step tags (`local_norm/...`, `micro_local_lm_loss`) repeat
once per micro-step, in micro-step order: the reader numbers the repeats within a step.

The same tag table names the TensorBoard scalars (`TENSORBOARD_TAGS` differs only where MindFormers
plots something else: the micro-batch loss as `local_lm_loss`).
"""
import re
from typing import Dict, List, Optional, Tuple

from mindmon.core.records import (DEVICE_LOSS, GRAD_NORM, LOCAL_LOSS, LOCAL_NORM, MAX_ATTENTION_LOGIT, MAX_ATTENTION_LOGIT_MAX,
                       MAX_ATTENTION_LOGIT_MEAN, Record)
from mindmon.formats.log_lines import NUMBER

LOSS_TAG = "lm"   # MindFormers' tag of the language-model loss
LOG_KIND_TAGS = {LOCAL_LOSS: f"micro_local_{LOSS_TAG}_loss", DEVICE_LOSS: f"device_accum_local_{LOSS_TAG}_loss",
                 GRAD_NORM: "device_local_norm", MAX_ATTENTION_LOGIT_MEAN: f"{MAX_ATTENTION_LOGIT}/mean",
                 MAX_ATTENTION_LOGIT_MAX: f"{MAX_ATTENTION_LOGIT}/max", "weight_norm": "weight_norm",
                 "throughput_linearity": "throughput_linearity"}
TENSORBOARD_KIND_TAGS = {**LOG_KIND_TAGS, LOCAL_LOSS: f"local_{LOSS_TAG}_loss"}
# Kinds written as `<kind>/<record name>`.
NAMED_KINDS = (LOCAL_NORM, MAX_ATTENTION_LOGIT, "adam_m_norm", "adam_v_norm", "weight_stable_rank",
               "weight_eigenvalue")
PER_MICRO_STEP = (LOCAL_NORM, LOCAL_LOSS)

LINE = re.compile(r"Epoch:\[\s*\d+/\s*\d+\], step:\[\s*(?P<step>\d+)/\s*(?:\d+|\?)\] (?P<tag>\S+): (?P<value>.+?)\s*$")


def tag(record: Record, table: Dict[str, str] = LOG_KIND_TAGS) -> Optional[str]:
    """MindFormers' tag of a record, None for a kind it has no tag for."""
    if record.kind in table:
        return table[record.kind]
    if record.kind in NAMED_KINDS:
        return f"{record.kind}/{record.name}"
    return None


def value_text(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(repr(float(v)) for v in value) + "]"
    return repr(float(value))


def line(step: int, max_steps: Optional[int], record_tag: str, value) -> str:
    return (f"Epoch:[{1:3d}/{1:3d}], step:[{step:5d}/{max_steps if max_steps is not None else '?':>5}] "
            f"{record_tag}: {value_text(value)}")


def _kind_of(record_tag: str) -> Optional[Tuple[str, str]]:
    """(kind, record name) of a tag."""
    for kind, known in LOG_KIND_TAGS.items():
        if record_tag == known:
            return kind, "global" if kind in ("weight_norm", "throughput_linearity", GRAD_NORM) else (
                "all" if kind in (MAX_ATTENTION_LOGIT_MEAN, MAX_ATTENTION_LOGIT_MAX) else "loss")
    kind, _, name = record_tag.partition("/")
    return (kind, name) if kind in NAMED_KINDS and name else None


class LineReader:
    """Records from lines of this format (other lines give nothing); numbers the micro-steps of the
    per-micro-step tags by their repeats within a step."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self._step = None
        self._repeats: Dict[str, int] = {}

    def read(self, text: str) -> List[Record]:
        match = LINE.search(text)
        if match is None:
            return []
        found = _kind_of(match["tag"])
        if found is None:
            return []
        kind, name = found
        step = int(match["step"])
        if step != self._step:
            self._step, self._repeats = step, {}
        micro_step = None
        if kind in PER_MICRO_STEP:
            micro_step = self._repeats.get(match["tag"], 0)
            self._repeats[match["tag"]] = micro_step + 1
        raw = match["value"]
        value = [float(v) for v in raw.strip("[]").split(",")] if raw.startswith("[") else float(raw)
        if not isinstance(value, list) and not re.fullmatch(NUMBER, raw):
            raise ValueError(f"not a number: {raw!r}")
        return [Record(step, micro_step, self.rank, kind, name, value)]
