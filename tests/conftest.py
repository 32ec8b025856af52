"""The fixtures every test folder shares, and the process set-up: real MindSpore on CPU, the hyper_parallel
stand-in for MindFormers 2.x (the helpers are in tests/support/).

MindFormers picks its log directory on first import, so it is pointed at a session temp dir
before anything imports it.
"""
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("LOG_MF_PATH", tempfile.mkdtemp(prefix="mindmon-test-log-"))
# A pytest-xdist worker inherits the folder its controller made above: each worker gets its own, so that
# mindformers_log() holds only the runs of the tests this process ran.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["LOG_MF_PATH"] = tempfile.mkdtemp(prefix=f"mindmon-test-log-{os.environ['PYTEST_XDIST_WORKER']}-")


def _mindformers_major():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("mindformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return None


# MindFormers 2.x imports hyper_parallel, which no package registry serves: in the environment that has
# MindFormers 2.0 (.venv-ms210), the tests' single-device stand-in goes on the path, before anything
# imports MindFormers (tests/support/hyper_parallel_standin/README.md).
HYPER_PARALLEL_STANDIN = Path(__file__).parent / "support" / "hyper_parallel_standin"
if _mindformers_major() == 2:
    sys.path.insert(0, str(HYPER_PARALLEL_STANDIN))

import mindspore as ms  # noqa: E402

# The alert tests' real servers, here so that the session-scoped ones start once per session
# (a fixture imported into several test modules would be one fixture per module).
from tests.support.servers import hanging_smtp, mariadb_server, postgres_server, postgres_url, smtp_inbox  # noqa: E402,F401
from tests.support.demo_trainer import VIEW_DEMO_CONFIG, VIEW_DEMO_STEPS

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def view_demo(tmp_path_factory):
    """`mindmon demo --config configs/tensorboard.yaml`: every monitor, the MaxLogitsMonitor callback
    and the TensorBoard sink on (a subprocess, as a user runs it); returns its --output directory.
    Shared by the TensorBoard, parse-log and report tests."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("view_demo")
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "demo", "--steps", str(VIEW_DEMO_STEPS),
                             "--output", str(out), "--config", str(VIEW_DEMO_CONFIG)],
                            capture_output=True, text=True, env=env, cwd=out, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out
