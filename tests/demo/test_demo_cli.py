"""`mindmon demo` as a new user runs it: a subprocess, the stock Trainer, the shipped YAML."""
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.jsonl import read_jsonl
from tests.formats.test_log_format import SEED_PATTERNS

STEPS, K = 6, 4


def _message(line):
    """A log line without the logger's prefix. mindmon writes a step's lines in one logging call, so
    only the first line of the block carries the prefix; the others are the documented lines as is."""
    if " - INFO - " in line:
        return line.split(" - INFO - ", 1)[1]
    if line.startswith(("{", "step:[")):
        return line
    return line.split("] ", 2)[-1].split(": ", 1)[-1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "demo", "--steps", str(STEPS), "--output", str(out)],
                            capture_output=True, text=True, env=env, cwd=out, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (out / "log" / "rank_0" / "info.log").read_text()
    messages = [_message(line) for line in log.splitlines()]
    return out, result.stdout, log, messages


def test_prints_where_outputs_went(demo):
    out, stdout, _, _ = demo
    assert f"metrics (JSONL): {out}/monitor/rank_0/metrics.jsonl" in stdout
    assert f"training log:    {out}/log" in stdout


def test_log_has_every_seed_format(demo):
    _, _, log, messages = demo
    assert "mindmon: attached to the MindFormers 1.9.0 PyNative Trainer" in log
    for name, pattern in SEED_PATTERNS.items():
        assert any(pattern.match(m) for m in messages), f"no {name} line in the training log"
    assert sum(1 for m in messages if SEED_PATTERNS["device_loss"].match(m)) == STEPS
    assert sum(1 for m in messages if SEED_PATTERNS["marker"].match(m)) == STEPS * K
    assert "step:[    6/    6], loss:" in log  # the stock LossCallback still runs


def test_jsonl_holds_every_micro_step(demo):
    out = demo[0]
    records = read_jsonl(out / "monitor" / "rank_0" / "metrics.jsonl")
    for step in range(1, STEPS + 1):
        rows = [r for r in records if r["step"] == step]
        for kind in ("local_loss", "local_norm", "micro_norm"):
            assert {r["micro_step"] for r in rows if r["kind"] == kind} == set(range(K)), (step, kind)
        assert len([r for r in rows if r["kind"] == "device_loss"]) == 1
        assert [r for r in rows if r["kind"] == "device_norm"]
    # The YAML filters local_norm to attention and layernorm parameters.
    assert all("attention" in r["name"] or "layernorm" in r["name"] for r in records if r["kind"] == "local_norm")


def test_logged_loss_is_the_jsonl_loss(demo):
    out, _, _, messages = demo
    records = read_jsonl(out / "monitor" / "rank_0" / "metrics.jsonl")
    device = [r["value"] for r in records if r["kind"] == "device_loss"]
    logged = [float(m.split('"device_loss": ')[1].rstrip(" }")) for m in messages if SEED_PATTERNS["device_loss"].match(m)]
    np.testing.assert_allclose(logged, device, atol=1e-6)
    assert device[-1] < device[0]  # the synthetic pattern is learnable
