"""Starts a test worker script on real msrun workers (CPU, one host) and returns what they left."""
import os
import shutil
import socket
import subprocess
import sys

from tests.support import HERE, REPO  # noqa: F401 (HERE: the tests import it here)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_workers(worker: str, args, cwd, ranks: int = 2, env=None, timeout: int = 600):
    """`msrun` with `ranks` local workers running tests/<worker> with `args`; the tests folder and the
    repository on PYTHONPATH. Returns (the finished process, {rank: its worker log})."""
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, **(env or {}), PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]))
    msrun = shutil.which("msrun", path=bin_dir) or "msrun"
    log_dir = os.path.join(str(cwd), "msrun_logs")
    result = subprocess.run([msrun, f"--worker_num={ranks}", f"--local_worker_num={ranks}",
                             f"--master_port={free_port()}", f"--log_dir={log_dir}", "--join=True",
                             os.path.join(HERE, worker), *map(str, args)],
                            env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    logs = {}
    for rank in range(ranks):
        path = os.path.join(log_dir, f"worker_{rank}.log")
        logs[rank] = open(path).read() if os.path.exists(path) else ""
    return result, logs
