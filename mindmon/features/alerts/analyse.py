"""`mindmon anomalies -d DIR [-o OUT] [-k 8] [-s STEPS]`: the first anomalies in time, across ranks.

Reads every `rank<r>/anomaly.json` below DIR (the `anomaly_detected` folder, or the monitor output
folder holding it), keeps the steps asked for, orders the entries by

    (step, micro-step (step-level values after every micro-step), phase (forward < gradients <
     optimizer and step-end values), pp_stage, vpp_stage, call_id, rank)

and writes the first k to `anomaly_analyse.json` (default: in DIR), keyed as in anomaly.json,
in that order. It reads msprobe's own dumps too (phase then comes from the tag name).

Example:
    mindmon anomalies -d output/monitor/anomaly_detected -k 5 -s 3-6
"""
import argparse
import json
import os
import re
import sys
from glob import glob
from typing import Dict, List, Optional, Sequence, Tuple

from mindmon.features.alerts.dump import DUMP_DIR, DUMP_FILE, write_json_atomically

ANALYSE_FILE = "anomaly_analyse.json"
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
    micro = entry.get("micro_step")
    return (entry["step"], float("inf") if micro is None else micro, phase(entry), entry.get("pp_stage", 0),
            entry.get("vpp_stage", 0), entry.get("call_id", 0), entry.get("rank", 0))


def parse_steps(text: Optional[str]) -> Optional[set]:
    """"[1, 2]", "1,2", "3-5" or "1 4-6" -> a set of steps; None/""/"[]" -> None (every step)."""
    if text is None:
        return None
    parts = [p for p in re.split(r"[\s,]+", text.strip().strip("[]")) if p]
    steps = set()
    for part in parts:
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if bounds is None:
            raise ValueError(f"-s/--step_list: cannot read {part!r}; allowed: steps like 3, 3-5 or [1, 2]")
        first = int(bounds.group(1))
        steps.update(range(first, int(bounds.group(2) or first) + 1))
    return steps or None


def dump_folder(data_path: str) -> str:
    nested = os.path.join(data_path, DUMP_DIR)
    return nested if os.path.isdir(nested) else data_path


def read_dumps(folder: str) -> List[Tuple[str, dict]]:
    entries = []
    for path in sorted(glob(os.path.join(folder, "rank*", DUMP_FILE))):
        with open(path, encoding="utf-8") as f:
            entries += list(json.load(f).items())
    return entries


def top_anomalies(entries: Sequence[Tuple[str, dict]], k: int, steps: Optional[set] = None):
    chosen = [(key, entry) for key, entry in entries if steps is None or entry["step"] in steps]
    return sorted(chosen, key=lambda item: order_key(item[1]))[:k]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-d", "--data_path", required=True,
                        help="the anomaly_detected folder (or the monitor output folder holding it)")
    parser.add_argument("-o", "--out_path", default=None,
                        help=f"where {ANALYSE_FILE} goes (default: the data folder)")
    parser.add_argument("-k", "--topk", type=int, default=8, help="how many anomalies to keep (default 8)")
    parser.add_argument("-s", "--step_list", default=None,
                        help='steps to analyse: "[1, 2]", "1,2", "3-5" (default: every step)')


def _print(top: Sequence[Tuple[str, dict]], out: str) -> None:
    print(f"{len(top)} first anomal{'y' if len(top) == 1 else 'ies'} -> {out}")
    for n, (_, entry) in enumerate(top, start=1):
        micro = "-" if entry.get("micro_step") is None else entry["micro_step"]
        print(f"{n:3d}. step {entry['step']} micro {micro} rank {entry.get('rank', 0)} "
              f"call {entry.get('call_id', 0)}: {entry.get('message', entry.get('tag_name'))}")


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.data_path):
        print(f"mindmon anomalies: {args.data_path}: no such folder", file=sys.stderr)
        return 1
    if args.topk < 1:
        print(f"mindmon anomalies: -k/--topk: got {args.topk}; allowed: a positive int", file=sys.stderr)
        return 1
    try:
        steps = parse_steps(args.step_list)
    except ValueError as error:
        print(f"mindmon anomalies: {error}", file=sys.stderr)
        return 1
    folder = dump_folder(args.data_path)
    entries = read_dumps(folder)
    if not entries:
        print(f"mindmon anomalies: no rank*/{DUMP_FILE} with anomalies under {folder}", file=sys.stderr)
        return 1
    top = top_anomalies(entries, args.topk, steps)
    out = args.out_path or folder
    out = os.path.join(out, ANALYSE_FILE) if not out.endswith(".json") else out
    result: Dict[str, dict] = dict(top)
    write_json_atomically(out, result)
    _print(top, out)
    return 0
