"""docs/model-parallel.md runs as written: its python block on 4 real msrun workers (TP=2 x DP=2), in an
empty folder. Step 1's numbers are checked against numpy float64 of the unsharded MLP (analytic gradients)
from the page's seed."""
import re
from pathlib import Path

import numpy as np
import pytest

from tests.support.jsonl import read_jsonl
from tests.support.msrun_launch import run_workers

pytestmark = pytest.mark.serial   # 4 msrun ranks

PAGE = Path(__file__).resolve().parents[2] / "docs" / "model-parallel.md"
RANKS, IN, HIDDEN, OUT, ROWS, K, STEPS = 4, 4, 8, 3, 4, 2, 2


@pytest.fixture(scope="module")
def page_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model_parallel_page")
    (code,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    (folder / "page.py").write_text(code, encoding="utf-8")
    result, logs = run_workers(str(folder / "page.py"), [], folder, ranks=RANKS)
    assert result.returncode == 0, result.stdout[-2000:] + "".join(log[-3000:] for log in logs.values())
    return {r: read_jsonl(folder / "output" / "monitor" / f"rank_{r}" / "metrics.jsonl") for r in range(RANKS)}


def _step1_reference():
    rng = np.random.default_rng(0)
    w1, w2 = rng.normal(0, 0.5, (IN, HIDDEN)), rng.normal(0, 0.5, (HIDDEN, OUT))
    x_all, y_all = rng.normal(size=(STEPS, 2 * ROWS, IN)), rng.normal(size=(STEPS, 2 * ROWS, OUT))
    losses, mean = {}, {"fc1": 0.0, "fc2": 0.0}
    rows = ROWS // K
    for replica in range(2):
        for k in range(K):
            x = x_all[0, replica * ROWS + k * rows:replica * ROWS + (k + 1) * rows]
            y = y_all[0, replica * ROWS + k * rows:replica * ROWS + (k + 1) * rows]
            hidden = np.maximum(x @ w1, 0)
            out = hidden @ w2
            losses[(replica, k)] = float(np.mean((out - y) ** 2))
            d_out = 2 * (out - y) / out.size
            mean["fc2"] = mean["fc2"] + hidden.T @ d_out / (K * 2)
            mean["fc1"] = mean["fc1"] + x.T @ ((d_out @ w2.T) * (hidden > 0)) / (K * 2)
    return losses, mean


def test_the_page_reports_the_unsharded_model(page_run):
    losses, mean = _step1_reference()
    grad_norm = np.sqrt(sum(np.sum(g ** 2) for g in mean.values()))
    for rank, records in page_run.items():
        replica, tp = rank // 2, rank % 2
        step1 = {(r["kind"], r["micro_step"], r["name"]): r["value"] for r in records if r["step"] == 1}
        np.testing.assert_allclose(step1[("grad_norm", None, "global")], grad_norm, rtol=1e-5)
        for k in range(K):
            np.testing.assert_allclose(step1[("local_loss", k, "loss")], losses[(replica, k)], rtol=1e-5)
        if tp == 0:
            for name in ("fc1", "fc2"):
                np.testing.assert_allclose(step1[("device_norm", None, name)], np.linalg.norm(mean[name]), rtol=1e-5)
        else:
            assert not [key for key in step1 if key[0] == "device_norm"]
        assert all((r["dp"], r["tp"]) == (replica, tp) for r in records)
