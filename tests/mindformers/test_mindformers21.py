"""MindFormers 2.1.0's Trainer as far as this machine runs it (`make test-ms210`): its source on MindSpore 2.10
(it asks for 2.11, which no registry serves) with the hyper_parallel stand-in, in a process of its own
(tests/support/mindformers21_run.py). mindmon attaches through its autoload, adapts 2.1.0's `training_step(step=None)`
(which fetches its micro-batches itself) and its loop's monitor calls; step 1's numbers equal numpy's.
2.1.0's own AdamW stops on the CPU (no AddcmulExt kernel), so the run passes MindSpore's AdamWeightDecay in."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.jsonl import read_jsonl
from tests.support.demo_trainer import trainer_config
from tests.features.train_state import test_train_state
from tests.support import HERE

pytestmark = pytest.mark.mindformers2

SUPPORT = Path(HERE)
ALL_TRAIN_STATE = {"local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True}


def _run(tmp_path, config, optimizer):
    env = dict(os.environ, LOG_MF_PATH=str(tmp_path / "log"))
    return subprocess.run([sys.executable, str(SUPPORT / "mindformers21_run.py"), json.dumps(config), optimizer],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def test_source_is_there():
    assert (Path(sys.prefix) / "mindformers-2.1.0" / "mindformers" / "pynative" / "trainer" / "trainer.py").exists(), \
        "make install-ms210 unpacks MindFormers 2.1.0 beside the environment"


def test_step1_on_2_1_0_equals_numpy(tmp_path):
    config = trainer_config(tmp_path / "out", steps=1, monitor={"train_state": ALL_TRAIN_STATE})
    result = _run(tmp_path, config, "mindspore-adamw")
    assert result.returncode == 0 and "trained" in result.stdout, result.stderr[-3000:]
    assert "versions: 2.1.0 _step_2_1" in result.stdout
    log = (tmp_path / "log" / "rank_0" / "info.log").read_text()
    assert log.count("mindmon: attached to the MindFormers 2.1.0 PyNative Trainer") == 1
    records = read_jsonl(tmp_path / "out" / "rank_0" / "metrics.jsonl")
    test_train_state.test_step1_matches_numpy((config, records, None))   # the 1.9.0 check, as it is


def test_2_1_0s_own_adamw_has_no_cpu_kernel(tmp_path):
    config = trainer_config(tmp_path / "out", steps=1, monitor={"train_state": {"device_loss": True}})
    result = _run(tmp_path, config, "mindformers-adamw")
    assert result.returncode != 0 and "AddcmulExt" in result.stderr, result.stderr[-3000:]
