"""A rank's place under model parallelism, in its output: `rank_<r>/layout.json` (the run's metadata) and
the coordinates every JSONL record of that rank carries as extra fields (readers that do not know them
ignore them; `mindmon.formats.jsonl.decode` does).

    rank_3/layout.json   {"rank": 3, "coordinates": {"dp": 1, "tp": 1, "pp": 0, "ep": 0, "cp": 0},
                          "sizes": {"dp": 2, "tp": 2, "pp": 1, "ep": 1, "cp": 1}, "vpp_chunks": 1,
                          "groups": {"dp": "mindmon-dp-1-3", "tp": "mindmon-tp-2-3"},
                          "sharded": {"attn.qkv.weight": {"axes": ["tp"], "dim": 1}}}
    metrics.jsonl        {"step": 1, ..., "value": 0.25, "dp": 1, "tp": 1, "pp": 0, "ep": 0, "cp": 0}

Example:
    layouts = read_layouts("./output/monitor")    # {3: {"coordinates": {...}, ...}, ...}
"""
import glob
import json
import os
from typing import Dict

from .run_folder import rank_dir, rank_in_path

LAYOUT_FILE = "layout.json"


def layout_path(output_dir: str, rank: int) -> str:
    return os.path.join(rank_dir(output_dir, rank), LAYOUT_FILE)


def describe(layout, rank: int) -> dict:
    return {"rank": rank, "coordinates": layout.coordinates(), "sizes": layout.sizes(),
            "vpp_chunks": layout.vpp_chunks,
            "groups": {axis: group.group for axis, group in layout.groups.items() if group.group is not None},
            "sharded": {name: {"axes": list(p.axes), "dim": p.dim} for name, p in sorted(layout.placements.items())}}


def write_layout(output_dir: str, layout, rank: int) -> None:
    path = layout_path(output_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(describe(layout, rank), handle, indent=1, sort_keys=True)


def coordinates_suffix(layout) -> str:
    """The text added before a JSONL line's closing brace: `, "dp": 1, "tp": 0, ...`."""
    return "".join(f', "{axis}": {index}' for axis, index in layout.coordinates().items())


def read_layouts(run_dir: str) -> Dict[int, dict]:
    """Every rank's layout.json at or below `run_dir`, by rank ({} for a run without model parallelism)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "**", LAYOUT_FILE), recursive=True)):
        rank = rank_in_path(os.path.dirname(path))
        if rank is not None:
            with open(path, encoding="utf-8") as handle:
                found.setdefault(rank, json.load(handle))
    return found
