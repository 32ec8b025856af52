"""monitor_v2's CSV files (msprobe's CSVWriterV2), written from mindmon's tensor-statistics records.

    <output_dir>/rank_<r>/<slug>_step<first>-<last>.csv     slug: module, weight_grad, optimizer, param, cc

The collectives (`cc`) rows are named by msprobe's tag name, `all_reduce/rank0/post_0_0`
(function/rank/<pre|post>_<call>_<tensor>, the call counted from 0 in each step), scope `comm`, no
`vpp_stage` (empty, as msprobe's rows carry none). A file holds `step_count_per_record` steps, counted from `start_step`. Header and row, as msprobe:

    vpp_stage,step,module_name,scope,micro_step,min,max
    -1,0,fc1.weight,unreduced,1,-0.25,0.5

`vpp_stage` is the model chunk when the name starts with `<c>:` (-1, msprobe's default stage, otherwise);
`micro_step` is in the weight_grad and module files (1-based, as monitor_v2 counts); the statistics are
the monitor's `ops`, each the float32 value written as Python writes a float (msprobe stacks float32
results). A slug's header is fixed by its first file; later files keep it.

`mean` is rounded as msprobe's `mint.mean` of a float32 tensor rounds it on MindSpore's CPU kernel: the
sum rounded to float32, then divided by the element count in float32 (`msprobe_mean`). The statistics
keep the mean as sum / count in float64; the sum is that times the count, whose float32 rounding is the
sum's unless the sum lies within 2**-53 of a float32 rounding boundary.
"""
import csv
import logging
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mindmon.core.engine import Sink
from mindmon.features.collectives.hooks import CC_POST, CC_PRE
from mindmon.features.tensor_stats.points import (ACTV, ACTV_GRAD, EXP_AVG, EXP_AVG_SQ, GRAD_REDUCED, GRAD_UNREDUCED,
                                                  PARAM_ORIGIN, PARAM_UPDATED)
from mindmon.formats.msprobe_tags import CC_PREFIXES, tag_name
from mindmon.core.records import TensorStatsRecord

logger = logging.getLogger("mindmon")

DEFAULT_STAGE = -1
BASE_FIELDS = ("vpp_stage", "step")
# mindmon's point -> (monitor_v2 slug, scope)
SLUG_SCOPES = {
    PARAM_ORIGIN: ("param", "param_origin"), PARAM_UPDATED: ("param", "param_updated"),
    GRAD_UNREDUCED: ("weight_grad", "unreduced"), GRAD_REDUCED: ("weight_grad", "reduced"),
    EXP_AVG: ("optimizer", "exp_avg"), EXP_AVG_SQ: ("optimizer", "exp_avg_sq"),
    ACTV: ("module", "forward"), ACTV_GRAD: ("module", "backward"),
    CC_PRE: ("cc", "comm"), CC_POST: ("cc", "comm"),
}
# monitor_v2's names of mindmon's activation-gradient rows: the gradient of a cell's input is its
# `grad_input`, of its output its `grad_output` (as msprobe 26.2.0 writes them on MindSpore 2.9).
GRADIENT_NAMES = {"input": "grad_input", "output": "grad_output"}
_ROW = re.compile(r"^(?P<cell>.*)\.(?P<io>input|output)(?:_(?P<index>\d+))?$")


def v2_slug_path(rank_dir: str, slug: str, step: int, per_file: int, start_step: int) -> str:
    """CSVWriterV2's file of a step: files start at start_step + a multiple of per_file."""
    relative = step - start_step
    first = step if relative < 0 else start_step + (relative // per_file) * per_file
    return os.path.join(rank_dir, f"{slug}_step{first}-{first + per_file - 1}.csv")


def vpp_stage(name: str) -> int:
    prefix, sep, _ = name.partition(":")
    return int(prefix) if sep and prefix.isdigit() else DEFAULT_STAGE


def module_row_name(point: str, name: str) -> str:
    """mindmon's activation row (`fc1.input`, `fc1.output_1`) as monitor_v2 names it (`fc1.input.0`,
    `fc1.output.1`; their gradients `fc1.grad_input.0`, `fc1.grad_output.1`)."""
    match = _ROW.match(name)
    if match is None:
        return name
    io = match.group("io") if point == ACTV else GRADIENT_NAMES[match.group("io")]
    return f"{match.group('cell')}.{io}.{match.group('index') or 0}"


def float32_value(value: float) -> float:
    return float(np.float32(value))


def msprobe_mean(mean: float, shape: Sequence[int]) -> float:
    """A float64 mean as msprobe writes it: float32(sum) / float32(count), divided in float32."""
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0 or not np.isfinite(mean):
        return float32_value(mean)
    with np.errstate(over="ignore"):
        return float(np.float32(np.float32(mean * count) / np.float32(count)))


class MonitorV2CsvSink(Sink):
    """Writes the records of mindmon's tensor statistics as monitor_v2's CSV files. `ops`: each slug's
    statistics (a record holds every slug's); `grad_acc_steps`: the micro-step of a step's summed and
    reduced gradients (monitor_v2 writes K there)."""

    def __init__(self, output_dir: str, rank: int, ops: Dict[str, Tuple[str, ...]], grad_acc_steps: int,
                 start_step: int = 0, step_count_per_record: int = 1):
        self.rank_dir = os.path.join(output_dir, f"rank_{rank}")
        self.ops, self.grad_acc_steps = dict(ops), grad_acc_steps
        self.start_step, self.per_file = start_step, step_count_per_record
        self.headers: Dict[str, List[str]] = {}

    def write(self, records: Sequence) -> None:
        by_file: Dict[Tuple[str, str], List[dict]] = {}
        for record in records:
            row = self._row(record) if isinstance(record, TensorStatsRecord) else None
            if row is not None:
                slug, step, fields = row
                path = v2_slug_path(self.rank_dir, slug, step, self.per_file, self.start_step)
                by_file.setdefault((slug, path), []).append(fields)
        for (slug, path), rows in by_file.items():
            self._append(slug, path, rows)

    def _row(self, record: TensorStatsRecord) -> Optional[Tuple[str, int, dict]]:
        slug_scope = SLUG_SCOPES.get(record.kind)
        if slug_scope is None or slug_scope[0] not in self.ops:
            return None
        slug, scope = slug_scope
        fields = {"module_name": self._name(record), "scope": scope}
        micro_step = self._micro_step(record)
        if micro_step is not None:
            fields["micro_step"] = micro_step
        # monitor_v2's cc rows carry no stage: CSVWriterV2 leaves the column empty
        fields["vpp_stage"] = "" if record.kind in CC_PREFIXES else vpp_stage(fields["module_name"])
        stats = dict(zip(record.ops, record.value))
        fields.update((op, float32_value(stats.get(op, float("nan")))) for op in self.ops[slug])
        if "mean" in fields:
            fields["mean"] = msprobe_mean(stats.get("mean", float("nan")), record.shape)
        fields["step"] = record.step - 1   # records count from 1; monitor_v2 from 0
        return slug, fields["step"], fields

    @staticmethod
    def _name(record: TensorStatsRecord) -> str:
        if record.kind in (ACTV, ACTV_GRAD):
            return module_row_name(record.kind, record.name)
        if record.kind in (EXP_AVG, EXP_AVG_SQ):   # the optimizer state's name, then the scope
            return f"{record.kind}.{record.name}.{record.kind}"
        if record.kind in CC_PREFIXES:   # the tag name: all_reduce/rank0/post_0_0
            return tag_name(record.kind, record.name, None, record.rank) or record.name
        return record.name

    def _micro_step(self, record: TensorStatsRecord) -> Optional[int]:
        if record.kind in (GRAD_UNREDUCED, GRAD_REDUCED):
            return self.grad_acc_steps if record.micro_step is None else record.micro_step + 1
        if record.kind in (ACTV, ACTV_GRAD):
            return None if record.micro_step is None else record.micro_step + 1
        return None

    def _append(self, slug: str, path: str, rows: List[dict]) -> None:
        fields = list(BASE_FIELDS) + list(dict.fromkeys(k for row in rows for k in row if k not in BASE_FIELDS))
        header = self.headers.setdefault(slug, fields)
        exists = os.path.exists(path)
        if not exists:
            header += [k for k in fields if k not in header]
        os.makedirs(self.rank_dir, exist_ok=True)
        with open(path, "a", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=header, extrasaction="ignore")
            if not exists:
                writer.writeheader()
            writer.writerows(rows)
