"""mindmon.parallel.data_parallel: every DataParallel function on two real msrun ranks (tests/support/dp_worker.py: sums of
float32, float16, int32 and scalar tensors and the max of an array, over the world and over the group
named, against numpy; the refusal of an unknown group to the character), and the one-process path."""
import os
import subprocess
import sys

import numpy as np

from mindmon.demo import launch
from tests.support import HERE

WORKER = os.path.join(HERE, "dp_worker.py")


def test_one_process_returns_its_input():
    from mindspore import Tensor

    from mindmon.parallel.data_parallel import DataParallel

    alone = DataParallel()
    assert (alone.size, alone.rank, alone.active) == (1, 0, False)
    tensors = [Tensor(np.ones(2, np.float32))]
    assert alone.sum(tensors)[0] is tensors[0] and alone.sum([]) == []
    values = np.array([1.5, -2.0])
    assert alone.max(values) is values
    assert DataParallel("dp")._kwargs() == {"group": "dp"} and alone._kwargs() == {}


def run_workers(tmp_path, env_extra=None) -> subprocess.CompletedProcess:
    """Two msrun workers running tests/support/dp_worker.py; the worker logs go to tmp_path/msrun. The workers
    import the mindmon this test imported (a mutation run's mutated copy, not an installed one)."""
    import mindmon

    command = [WORKER if part == launch.WORKER else part for part in launch.msrun_command(2, str(tmp_path / "msrun"), [])]
    source = os.path.dirname(os.path.dirname(os.path.abspath(mindmon.__file__)))
    python_path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=python_path, **(env_extra or {}))
    env.pop("LOG_MF_PATH", None)
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_two_ranks_sum_and_max_against_numpy(tmp_path):
    # mutmut reruns a test for a mutant only if the test called the mutated function in its own process
    # (the workers' calls are not seen): the one-process path first, then the two ranks.
    test_one_process_returns_its_input()
    result = run_workers(tmp_path)
    logs = [(tmp_path / "msrun" / f"worker_{rank}.log").read_text() for rank in (0, 1)]
    assert result.returncode == 0, result.stdout[-2000:] + "".join(log[-3000:] for log in logs)
    for rank, log in enumerate(logs):
        assert f"dp_worker rank {rank}: ok" in log, log[-3000:]
