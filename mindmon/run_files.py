"""Finding and reading the per-rank metrics files of a run (finished or still being written).

Example:
    for rank, path in metrics_files("./output"):          # ./output/monitor/rank_0/metrics.jsonl, ...
        records = read_records(path)
"""
import glob
import json
import os
import re
import sys
from typing import List, Tuple

from .records import Record

_RANK_DIR = re.compile(r"rank_(\d+)$")


def metrics_files(run_dir: str) -> List[Tuple[int, str]]:
    """(rank, path) of every `rank_<r>/metrics.jsonl` at or below `run_dir` (a metrics file itself
    is accepted too), sorted by rank. Raises FileNotFoundError naming what was looked for."""
    if os.path.isfile(run_dir):
        match = _RANK_DIR.search(os.path.basename(os.path.dirname(os.path.abspath(run_dir))))
        return [(int(match.group(1)) if match else 0, run_dir)]
    found = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "**", "metrics.jsonl"), recursive=True)):
        match = _RANK_DIR.search(os.path.dirname(path))
        if match:
            found.setdefault(int(match.group(1)), path)
    if not found:
        raise FileNotFoundError(f"no rank_<r>/metrics.jsonl at or below {run_dir!r}; pass the run's output "
                                f"directory (monitor.output_dir, or the demo's --output)")
    return sorted(found.items())


def record_from_json(row: dict) -> Record:
    extra = {"iteration": row["iter"]} if "iter" in row else {}
    return Record(row["step"], row["micro_step"], row["rank"], row["kind"], row["name"], row["value"], **extra)


def read_records(path: str) -> List[Record]:
    """The file's records. A run in progress may have a last line half written: it is left out,
    as is any line that is not a record (said once on stderr)."""
    records, bad = [], 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                records.append(record_from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                bad += 1
    if bad:
        print(f"mindmon: {path}: {bad} line(s) that are not records were skipped", file=sys.stderr)
    return records
