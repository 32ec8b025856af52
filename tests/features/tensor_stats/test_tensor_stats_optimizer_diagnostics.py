"""ur_distribution (Adam's bias-corrected update and ratio: statistics and histograms) and mg_direction, through
msprobe's TrainerMon on real MindSpore optimizers, against numpy from each optimizer's own m and v, read by the
test before every update (kj600's heat maps: test_kj600_heatmaps.py)."""
import glob
import json
import os

import numpy as np
import pytest

from mindspore import nn

from tests.support.msprobe_reference import (BETA1_F32, BETA2_F32, K, NAMES, STEPS, make_model, make_optimizer, statistic,
                               train_steps)
from mindmon.config import ConfigError
from mindmon.formats import jsonl
from mindmon.formats.msprobe_csv import read_csv
from mindmon.msprobe import TrainerMon, parse_tensor_stats
from mindmon.sinks.jsonl import JsonlSink

pytestmark = pytest.mark.ms27

OPS = ["min", "max", "mean", "norm"]
CONFIG = {"targets": {}, "ur_distribution": True, "mg_direction": True, "ops": OPS, "ndigits": 16}
# Where each optimizer keeps m and v, and its eps (nn optimizers hold eps as a float32 tensor).
MOMENTS = {"AdamWeightDecay": ("moments1", "moments2", float(np.float32(1e-6))),
           "Adam": ("moment1", "moment2", float(np.float32(1e-8))),
           "experimental.Adam": ("exp_avg", "exp_avg_sq", 1e-8),
           "experimental.AdamW": ("exp_avg", "exp_avg_sq", 1e-8),
           "mindformers.AdamW": ("exp_avg", "exp_avg_sq", float(np.float32(1e-8)))}


@pytest.fixture(autouse=True)
def output_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    return tmp_path / "out"


def train(tmp_path, kind, config=CONFIG, steps=STEPS):
    """msprobe's loop; before every update the test copies the gradients and the optimizer's m and v."""
    model = make_model()
    model.set_train(True)
    optimizer = make_optimizer(kind, model.trainable_params())
    monitor = TrainerMon.from_config(parse_tensor_stats(config), [JsonlSink(str(tmp_path / "jsonl"))], False)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    first, second, _ = MOMENTS[kind]
    seen = []

    def copy_state(summed):
        seen.append({name: (g.asnumpy().copy(), getattr(optimizer, first)[i].asnumpy().copy(),
                            getattr(optimizer, second)[i].asnumpy().copy())
                     for i, (name, g) in enumerate(zip(NAMES, summed))})

    train_steps(model, optimizer, steps, copy_state)
    monitor.close()
    return seen, monitor.sink.folder


def counts(vector):
    """[< -1, 30 bins over [-1, 1] (the last one closed), > 1, NaN], by bin edges."""
    flat = vector.reshape(-1)
    finite = flat[np.isfinite(flat)]
    edges = np.linspace(-1, 1, 31)
    inside = finite[(finite >= -1) & (finite <= 1)]
    index = np.minimum(np.searchsorted(edges, inside, side="right") - 1, 29)
    return [int((flat < -1).sum())] + np.bincount(index, minlength=30).tolist() + \
        [int((flat > 1).sum()), int(np.isnan(flat).sum())]


def expected_vectors(seen, eps):
    """{(kind, step, name): update or ratio vector} for every step after the first (t = step updates made)."""
    out = {}
    for t, state in enumerate(seen):
        for name, (_, m, v) in state.items():
            if t == 0:
                continue
            m_hat = m.astype(np.float64) / (1 - BETA1_F32 ** t)
            root = np.sqrt(v.astype(np.float64) / (1 - BETA2_F32 ** t))
            with np.errstate(divide="ignore", invalid="ignore"):
                out[("adam_update", t, name)] = m_hat / (root + eps)
                out[("adam_ratio", t, name)] = m_hat / root
    return out


def csv_rows(folder, prefix):
    rows = {}
    for path in glob.glob(os.path.join(folder, f"{prefix}_*.csv")):
        rows.update({(record.kind, record.step - 1, record.name): record for record in read_csv(path)})
    return rows


@pytest.mark.parametrize("kind", ["AdamWeightDecay", "Adam", "experimental.Adam", "experimental.AdamW",
                                  pytest.param("mindformers.AdamW", marks=pytest.mark.mindformers)])
def test_update_ratio_and_direction_match_numpy(tmp_path, kind):
    seen, folder = train(tmp_path, kind)
    vectors = expected_vectors(seen, MOMENTS[kind][2])
    rows = {**csv_rows(folder, "adam_update"), **csv_rows(folder, "adam_ratio")}
    assert set(rows) == set(vectors)   # no row at step 0: no update made, nothing to correct
    for key, vector in vectors.items():
        for op, value in zip(rows[key].ops, rows[key].value):
            want = statistic(vector, op)
            assert value == pytest.approx(want, rel=1e-9, abs=1e-15, nan_ok=True), (key, op)
    histograms = {(r.kind.replace("_histogram", ""), r.step - 1, r.name): r.value
                  for _, path in jsonl.metrics_files(str(tmp_path / "jsonl")) for r in jsonl.read_records(path)
                  if r.kind.endswith("_histogram")}
    assert histograms == {key: counts(vector) for key, vector in vectors.items()}
    assert all(sum(c) == vectors[key].size for key, c in histograms.items())   # nothing dropped
    # At t = 1 the update is m_hat / sqrt(v_hat) = sign(g) up to rounding: outside [-1, 1] by a hair at times.
    assert any(c[0] + c[31] for (kind_, t, _), c in histograms.items() if t == 1)
    direction = csv_rows(folder, "mg_direction")
    assert set(direction) == {("mg_direction", t, name) for t in range(STEPS) for name in NAMES}
    for (_, t, name), record in direction.items():
        g, m, _ = seen[t][name]
        want = 1.0 if t == 0 else ((np.sign(g.astype(np.float64)) * np.sign(m)).sum() / m.size + 1) / 2
        assert record.value == pytest.approx([want, want, want, abs(want)], rel=1e-12), (t, name)


def test_optimizer_without_moments_is_one_line_at_set_monitor(tmp_path):
    model = make_model()
    for key in ("ur_distribution", "mg_direction"):
        monitor = TrainerMon.from_config(parse_tensor_stats({key: True}))
        with pytest.raises(ConfigError) as error:
            monitor.set_monitor(model, K, nn.SGD(model.trainable_params(), 0.1))
        assert str(error.value) == (f"{key}: got True, but the optimizer SGD keeps no Adam moments mindmon can "
                                    f"read; allowed: an Adam-type optimizer (nn.Adam, nn.AdamWeightDecay, "
                                    f"mindspore.experimental.optim.Adam/AdamW, MindFormers AdamW) or {key}: false")


def test_alert_rule_on_mg_direction(tmp_path, monkeypatch):
    """AnomalyNan with a threshold on mg_direction's mean fires exactly where numpy's share is above it."""
    threshold = 0.8
    rule = {"rule_name": "AnomalyNan", "args": {"threshold": threshold}, "kinds": ["mg_direction"],
            "statistics": ["mean"]}
    seen, _ = train(tmp_path, "AdamWeightDecay", {**CONFIG, "alert": {"rules": [rule], "dump": True}})
    (dump,) = glob.glob(str(tmp_path / "out" / "anomaly_detected" / "rank0" / "anomaly.json"))
    with open(dump) as handle:
        fired = {(e["step"], e["name"]) for e in json.load(handle).values()}
    expected = set()
    for t, state in enumerate(seen):
        for name, (g, m, _) in state.items():
            share = 1.0 if t == 0 else ((np.sign(g.astype(np.float64)) * np.sign(m)).sum() / m.size + 1) / 2
            if share > threshold:
                expected.add((t, f"{name}/mean"))
    assert fired == expected and 0 < len(expected) < STEPS * len(NAMES)

