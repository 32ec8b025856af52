"""The offline tools as they were in pure Python, before the analysis engine: the tests compare the
engine's output with theirs on the same files (merged.csv byte for byte, the anomaly order)."""
import csv
import json
import math
import os
import re
from collections import defaultdict
from glob import glob
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mindmon.formats.jsonl import metrics_files, read_records
from mindmon.core.records import LOCAL_LOSS, MICRO_NORM

DUMP_FILE = "anomaly.json"

PER_RANK_KINDS = (LOCAL_LOSS, MICRO_NORM)
COLUMNS = ["kind", "name", "step", "micro_step", "ranks", "min", "max", "mean", "max_rank", "outlier_rank"]

Key = Tuple[str, str, int, Optional[int]]


def _collect(run_dir: str) -> Dict[Key, Dict[int, float]]:
    values: Dict[Key, Dict[int, float]] = defaultdict(dict)
    for rank, path in metrics_files(run_dir):
        for record in read_records(path):
            if not isinstance(record.value, list):
                values[(record.kind, record.name, record.step, record.micro_step)][rank] = float(record.value)
    return values


def outlier(kind: str, per_rank: Dict[int, float], factor: float) -> Optional[int]:
    """The rank whose per-rank value stands out (see the module docstring), or None."""
    if kind not in PER_RANK_KINDS or len(per_rank) < 2:
        return None
    for rank, value in per_rank.items():
        if not math.isfinite(value):
            return rank
    for rank, value in sorted(per_rank.items(), key=lambda item: -item[1]):
        others = np.median([v for r, v in per_rank.items() if r != rank])
        if others > 0 and value > factor * others:
            return rank
    return None


def _row(key: Key, per_rank: Dict[int, float], factor: float) -> List:
    kind, name, step, micro_step = key
    finite = {r: v for r, v in per_rank.items() if math.isfinite(v)} or per_rank
    max_rank = max(finite, key=finite.get)
    flagged = outlier(kind, per_rank, factor)
    values = np.array([per_rank[r] for r in sorted(per_rank)], dtype=np.float64)
    # numpy's min/max/mean are NaN when any rank's value is NaN, whatever the rank order.
    return [kind, name, step, "" if micro_step is None else micro_step, len(per_rank),
            float(values.min()), float(values.max()), float(values.mean()),
            max_rank, "" if flagged is None else flagged]


def merge(run_dir: str, output: Optional[str] = None, factor: float = 5.0) -> Tuple[str, List[List]]:
    """Writes the table; returns its path and the flagged rows."""
    if factor <= 1:
        raise ValueError(f"factor: got {factor}; allowed: a number > 1")
    values = _collect(run_dir)
    order = sorted(values, key=lambda k: (k[2], -1 if k[3] is None else k[3], k[0], k[1]))
    rows = [_row(key, values[key], factor) for key in order]
    output = output or os.path.join(run_dir if os.path.isdir(run_dir) else os.path.dirname(run_dir), "merged.csv")
    with open(output, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
    return output, [row for row in rows if row[-1] != ""]


# --- the anomaly order ---

FORWARD_KINDS = ("actv", "local_loss", "max_attention_logit", "tokens_per_expert")
GRADIENT_KINDS = ("actv_grad", "grad_unreduced", "local_norm", "micro_norm", "grad_reduced", "device_norm",
                  "grad_norm")


def phase(entry: dict) -> int:
    """0 forward, 1 gradients, 2 optimizer state and step-end values."""
    kind = entry.get("kind")
    if kind is None:  # an msprobe dump: `<module>/rank<r>/<input|output>[_grad]` or a parameter tag
        tag = entry.get("tag_name", "")
        if tag.endswith("_grad"):
            return 1
        if re.search(r"/(input|output)(_\d+)?$", tag):
            return 0
        return 2 if "exp_avg" in tag else 1
    if kind in FORWARD_KINDS:
        return 0
    return 1 if kind in GRADIENT_KINDS else 2


def order_key(entry: dict) -> tuple:
    """msprobe's order: in the forward phase the virtual and pipeline stages ascending, else descending."""
    micro = entry.get("micro_step")
    sign = 1 if phase(entry) == 0 else -1
    return (entry["step"], float("inf") if micro is None else micro, phase(entry), sign * entry.get("vpp_stage", 0),
            sign * entry.get("pp_stage", 0), entry.get("call_id", 0), entry.get("rank", 0))


def read_dumps(folder: str) -> List[Tuple[str, dict]]:
    entries = []
    for path in sorted(glob(os.path.join(folder, "rank*", DUMP_FILE))):
        with open(path, encoding="utf-8") as f:
            entries += list(json.load(f).items())
    return entries


def top_anomalies(entries: Sequence[Tuple[str, dict]], k: int, steps: Optional[set] = None):
    chosen = [(key, entry) for key, entry in entries if steps is None or entry["step"] in steps]
    return sorted(chosen, key=lambda item: order_key(item[1]))[:k]


