"""The run directory: one `rank_<r>/` folder per rank under each output root (metrics, TensorBoard
events, profiler traces), and the x axis of micro-step values.

Micro-step k (0-based) of step s (1-based) with K micro-steps per step is global micro-step
`(s - 1) * K + k`, 0-based, as upstream MindFormers prints `iter`.
"""
import os
import re
from typing import Optional

RANK_DIR = re.compile(r"(?:^|[/\\])rank_(\d+)(?=$|[/\\])")


def rank_dir(root: str, rank: int) -> str:
    return os.path.join(root, f"rank_{rank}")


def rank_in_path(path: str) -> Optional[int]:
    """The rank of the last `rank_<r>` folder in a path, or None."""
    found = RANK_DIR.findall(os.path.abspath(path))
    return int(found[-1]) if found else None


def global_micro_step(step: int, micro_step: int, micro_steps_per_step: int) -> int:
    return (step - 1) * micro_steps_per_step + micro_step
