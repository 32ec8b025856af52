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


LOCK_FILE = "run.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        return True
    return True


class RunLock:
    """`rank_<r>/run.lock` holds `<pid> <host>` of the run writing that folder, so that a second run
    started into the same output directory is refused instead of mixing its records with the first's.
    A lock left by a process that is gone (same host, pid not running) is taken over."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, LOCK_FILE)
        self.held = False

    def owner(self) -> Optional[tuple]:
        """(pid, host) of a live run holding the folder (this process excluded), or None."""
        import socket

        try:
            with open(self.path, encoding="utf-8") as handle:
                pid_text, host = handle.read().split()[:2]
            pid = int(pid_text)
        except (OSError, ValueError):
            return None
        if pid == os.getpid() and host == socket.gethostname():
            return None
        if host == socket.gethostname() and not _alive(pid):
            return None
        return pid, host

    def acquire(self) -> None:
        import socket

        with open(self.path, "w", encoding="utf-8") as handle:
            handle.write(f"{os.getpid()} {socket.gethostname()}\n")
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except OSError:
                pass
