"""`mindmon demo --workers N`: the demo as N data-parallel processes under MindSpore's `msrun`.

msrun starts N copies of `mindmon/demo/worker.py`; each joins the process group (`mccl` on CPU),
trains its shard of the data and writes its own `rank_<r>/` outputs. msrun runs `python` from PATH,
so the interpreter running this command is put first on it.
"""
import os
import re
import shutil
import socket
import subprocess
import sys
from typing import List, Optional

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def msrun_command(workers: int, log_dir: str, worker_args: List[str]) -> List[str]:
    bin_dir = os.path.dirname(sys.executable)
    msrun = shutil.which("msrun", path=bin_dir) or shutil.which("msrun")
    if msrun is None:
        raise FileNotFoundError("msrun not found next to this Python or on PATH; it comes with mindspore")
    return [msrun, f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={_free_port()}",
            f"--log_dir={log_dir}", "--join=True", WORKER, *worker_args]


def launch(workers: int, output: str, steps: Optional[int], config: Optional[str], timeout: int = 3600) -> int:
    """Run the demo on `workers` processes; returns msrun's exit code. Worker logs: <output>/msrun/."""
    args = ["--output", output] + (["--steps", str(steps)] if steps else []) + (["--config", config] if config else [])
    log_dir = os.path.join(output, "msrun")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run(msrun_command(workers, log_dir, args), env=env, timeout=timeout).returncode


TRAINED_LINE = "mindmon demo: trained "
# MindSpore's cluster manager names the first worker that stopped answering.
TIMED_OUT = re.compile(r"worker (\d+) is the first one timed out")


def lost_ranks(log_dir: str, workers: int) -> List[str]:
    """After a failed run: what each rank that did not finish did, from the worker logs msrun wrote."""
    notes = []
    for rank in range(workers):
        path = os.path.join(log_dir, f"worker_{rank}.log")
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        except OSError:
            notes.append(f"rank {rank}: no log ({path})")
            continue
        if TRAINED_LINE in text:
            continue
        timed_out = TIMED_OUT.search(text)
        if timed_out:
            notes.append(f"rank {timed_out.group(1)} was lost (it stopped answering; MindSpore ended the job)")
        notes.append(f"rank {rank}: {'raised an error' if 'Traceback' in text else 'ended without finishing'} "
                     f"(see {path})")
    return list(dict.fromkeys(notes))
