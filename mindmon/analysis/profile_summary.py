"""The operators that took the most time, from the tables MindSpore Profiler writes.

On CPU, MindSpore 2.9 writes `FRAMEWORK/cpu_op_detail_info_<id>.csv` in each trace folder
(`<host>_<pid>_<timestamp>_ascend_ms`): one row per operator instance name with its call count
and total time in ms. `summarize(DIR)` finds those tables anywhere under DIR (a trace folder, a
`rank_<r>` folder or the whole `output_path`) and totals them per operator type or name.

Example:
    for trace in summarize("./output/profile/rank_0"):
        print(format_trace(trace, top=10))
"""
import csv
import glob
import os
from dataclasses import dataclass
from typing import Dict, List

CPU_OP_TABLE = os.path.join("FRAMEWORK", "cpu_op_detail_info_*.csv")
GROUP_COLUMNS = {"type": "op_type", "name": "full_op_name"}


class NoProfileData(FileNotFoundError):
    """No operator table under the folder given."""


@dataclass(frozen=True)
class OpTotal:
    """One operator type (or name) over a whole trace."""

    name: str
    calls: int
    total_ms: float

    @property
    def avg_ms(self) -> float:
        return self.total_ms / self.calls if self.calls else 0.0


@dataclass(frozen=True)
class TraceSummary:
    """The operators of one trace folder, most time first."""

    trace_dir: str
    table: str
    ops: List[OpTotal]

    @property
    def total_ms(self) -> float:
        return sum(op.total_ms for op in self.ops)


def find_op_tables(root: str) -> List[str]:
    """Every CPU operator table under `root`, in path order."""
    direct = glob.glob(os.path.join(root, CPU_OP_TABLE))
    return sorted(direct or glob.glob(os.path.join(root, "**", CPU_OP_TABLE), recursive=True))


def read_op_table(path: str, by: str = "type") -> List[OpTotal]:
    """Calls and total time per operator type (`by="type"`) or full name (`by="name"`), most time first."""
    column = GROUP_COLUMNS[by]
    calls: Dict[str, int] = {}
    total: Dict[str, float] = {}
    with open(path, newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            name = row[column]
            calls[name] = calls.get(name, 0) + int(row["op_occurrences"])
            total[name] = total.get(name, 0.0) + float(row["op_total_time(ms)"])
    ops = [OpTotal(name, calls[name], total[name]) for name in total]
    return sorted(ops, key=lambda op: (-op.total_ms, op.name))


def summarize(root: str, by: str = "type") -> List[TraceSummary]:
    """One summary per trace folder found under `root`."""
    if by not in GROUP_COLUMNS:
        raise ValueError(f"by: got {by!r}; allowed: {sorted(GROUP_COLUMNS)}")
    tables = find_op_tables(root)
    if not tables:
        raise NoProfileData(
            f"{root}: no {CPU_OP_TABLE} found under it. Give the profiler's output_path, a rank_<r> folder "
            f"or a *_ascend_ms trace folder written by a finished window (on an NPU, MindSpore writes "
            f"ASCEND_PROFILER_OUTPUT/kernel_details.csv instead; open the folder in MindStudio Insight)")
    return [TraceSummary(os.path.dirname(os.path.dirname(t)), t, read_op_table(t, by)) for t in tables]


def format_trace(trace: TraceSummary, top: int = 10, by: str = "type") -> str:
    """A fixed-width table of the `top` operators of one trace, with each one's share of the total."""
    shown = trace.ops[:top]
    width = max([len("operator " + by)] + [len(op.name) for op in shown])
    lines = [f"{trace.trace_dir}",
             f"  top {len(shown)} of {len(trace.ops)} operator {by}s by total time "
             f"({sum(op.calls for op in trace.ops)} calls, {trace.total_ms:.3f} ms in all; "
             f"from {os.path.relpath(trace.table, trace.trace_dir)})",
             f"  {'operator ' + by:<{width}}  {'calls':>7}  {'total ms':>10}  {'avg ms':>9}  {'share':>6}"]
    for op in shown:
        share = 100.0 * op.total_ms / trace.total_ms if trace.total_ms else 0.0
        lines.append(f"  {op.name:<{width}}  {op.calls:>7d}  {op.total_ms:>10.3f}  {op.avg_ms:>9.4f}  {share:>5.1f}%")
    return "\n".join(lines)
