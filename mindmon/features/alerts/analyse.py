"""`mindmon anomalies -d DIR [-o OUT] [-k 8] [-s STEPS]`: the first anomalies in time, across ranks.

Reads every `rank<r>/anomaly.json` below DIR (the `anomaly_detected` folder, or the monitor output
folder holding it), keeps the steps asked for, orders the entries by

    (step, micro-step (step-level values after every micro-step), phase (forward < gradients <
     optimizer and step-end values), then, as msprobe orders pipeline stages: in the forward phase
     vpp_stage and pp_stage ascending (the order a micro-batch runs through the chunks and stages),
     in the others both descending (the backward pass's order), then call_id, rank)

and writes the first k to `anomaly_analyse.json` (default: in DIR), keyed as in anomaly.json,
in that order. It reads msprobe's own dumps too: the phase then comes from the tag name as msprobe's
analyser takes it (`.../actv` forward; `.../param_origin`, `.../param_updated` before the forward;
`..._grad` gradients; `.../exp_avg[_sq]` optimizer), older tag forms (`.../input`, `.../output_1`) forward.

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

from mindmon.extras import MissingExtraError
from mindmon.features.alerts.dump import DUMP_DIR, DUMP_FILE, write_json_atomically

ANALYSE_FILE = "anomaly_analyse.json"
FORWARD_KINDS = ("actv", "local_loss", "max_attention_logit", "tokens_per_expert")
GRADIENT_KINDS = ("actv_grad", "grad_unreduced", "local_norm", "micro_norm", "grad_reduced", "device_norm",
                  "grad_norm")
# msprobe's analyser stages its dump's entries by the tag's last part: `actv` is the forward (MindSpore's
# `0:fc1.input:0/rank0/actv`), and points it has no stage for (the parameters before and after the
# update) come before every stage of their micro-step.
MSPROBE_FORWARD_POINTS = ("actv",)
MSPROBE_UNSTAGED_POINTS = ("param_origin", "param_updated")


# The order of the module docstring, in DuckDB: ties keep the file order (rank folders sorted, then
# each file's keys in order). An msprobe dump has no `kind`: its phase comes from the tag name.
ORDER_SQL = """
WITH files AS (SELECT unnest($paths) AS filename, generate_subscripts($paths, 1) AS file_no),
entries AS (
    SELECT files.file_no, j.id AS position, j.key, j.value AS entry, j.value ->> 'kind' AS kind,
           coalesce(j.value ->> 'tag_name', '') AS tag
    FROM read_text($paths) AS t JOIN files USING (filename), json_each(CAST(t.content AS JSON)) AS j
),
phased AS (
    SELECT *, CASE WHEN kind IS NULL THEN
                  -- msprobe's stage of its point (the tag's last part), before the older tag forms
                  CASE WHEN list_contains($msprobe_forward, regexp_extract(tag, '[^/]*$')) THEN 0
                       WHEN list_contains($msprobe_first, regexp_extract(tag, '[^/]*$')) THEN -1
                       WHEN ends_with(tag, '_grad') THEN 1 WHEN regexp_matches(tag, '/(input|output)(_\\d+)?$') THEN 0
                       WHEN contains(tag, 'exp_avg') THEN 2 ELSE 1 END
              WHEN list_contains($forward, kind) THEN 0 WHEN list_contains($gradient, kind) THEN 1 ELSE 2 END
              AS phase
    FROM entries
)
SELECT file_no, key FROM phased
WHERE $steps IS NULL OR list_contains($steps, CAST(entry ->> 'step' AS BIGINT))
ORDER BY CAST(entry ->> 'step' AS DOUBLE),
         coalesce(CAST(entry ->> 'micro_step' AS DOUBLE), CAST('inf' AS DOUBLE)),
         phase,
         -- the forward pass runs chunk by chunk, each through the stages in order; the backward the reverse
         (CASE WHEN phase = 0 THEN 1 ELSE -1 END) * coalesce(CAST(entry ->> 'vpp_stage' AS BIGINT), 0),
         (CASE WHEN phase = 0 THEN 1 ELSE -1 END) * coalesce(CAST(entry ->> 'pp_stage' AS BIGINT), 0),
         coalesce(CAST(entry ->> 'call_id' AS BIGINT), 0), coalesce(CAST(entry ->> 'rank' AS BIGINT), 0),
         file_no, position
LIMIT $k
"""


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


def dump_files(folder: str) -> List[str]:
    return sorted(glob(os.path.join(folder, "rank*", DUMP_FILE)))


def read_dumps(paths: Sequence[str]) -> List[Dict[str, dict]]:
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            out.append(json.load(f))
    return out


def top_anomalies(paths: Sequence[str], k: int, steps: Optional[set] = None) -> List[Tuple[str, dict]]:
    """The first k (key, entry) of these anomaly.json files in the module's order, ordered by DuckDB."""
    from mindmon.analysis.sql import duckdb

    dumps = read_dumps(paths)
    con = duckdb().connect()
    try:
        order = con.execute(ORDER_SQL, {"paths": list(paths), "k": k, "forward": list(FORWARD_KINDS),
                                        "gradient": list(GRADIENT_KINDS),
                                        "msprobe_forward": list(MSPROBE_FORWARD_POINTS),
                                        "msprobe_first": list(MSPROBE_UNSTAGED_POINTS),
                                        "steps": None if steps is None else sorted(steps)}).fetchall()
    finally:
        con.close()
    return [(key, dumps[file_no - 1][key]) for file_no, key in order]


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
    paths = dump_files(folder)
    if not any(read_dumps(paths)):
        print(f"mindmon anomalies: no rank*/{DUMP_FILE} with anomalies under {folder}", file=sys.stderr)
        return 1
    try:
        top = top_anomalies(paths, args.topk, steps)
    except MissingExtraError as error:
        print(f"mindmon anomalies: {str(error).replace('mindmon: ', '', 1)}", file=sys.stderr)
        return 1
    out = args.out_path or folder
    out = os.path.join(out, ANALYSE_FILE) if not out.endswith(".json") else out
    result: Dict[str, dict] = dict(top)
    write_json_atomically(out, result)
    _print(top, out)
    return 0
