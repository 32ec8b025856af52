"""mindmon in a plain MindSpore loop (no MindFormers), as README shows; and failure isolation."""
import logging

import numpy as np
import pytest
from mindspore import Tensor, nn

from tests.support.jsonl import read_jsonl
from mindmon.core.engine import Monitor
from mindmon.core.events import MicroBatchLoss
from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
from mindmon.kernels.stats import SquaredNorms
from tests.support.scripts.plain_loop_job import Regression

pytestmark = pytest.mark.ms27   # also runs on MindSpore 2.7 (make test-ms27)


def _data(rng, n=8):
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype(np.float32)
    return x, y


def test_readme_loop_matches_numpy(tmp_path, rng):
    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path), "train_state": {
        "local_norm": True, "local_loss": True, "device_norm": "weight", "device_loss": True}}}),
        parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=4, group=group, max_norm=0.0)
    group.setup()
    x, y = _data(rng)
    w, b = np.full((3, 1), 0.5), np.zeros(1)
    for step in (1, 2):
        loss, grad_norm = train_step(split_batch((Tensor(x), Tensor(y)), 4))
        group.flush(step)
        # numpy: the same four micro-batches of 2 samples, gradients of loss_k / 4, one SGD update
        records = [r for r in read_jsonl(tmp_path / "rank_0" / "metrics.jsonl") if r["step"] == step]
        acc_w, acc_b, prev_w, losses = np.zeros_like(w), np.zeros_like(b), 0.0, []
        for k in range(4):
            xs, ys = x[2 * k:2 * k + 2].astype(np.float64), y[2 * k:2 * k + 2].astype(np.float64)
            diff = xs @ w + b - ys
            losses.append(np.mean(diff ** 2))
            acc_w += xs.T @ diff / diff.size * 2 / 4
            acc_b += np.sum(diff, axis=0) / diff.size * 2 / 4
            got = {(r["kind"], r["name"]): r["value"] for r in records if r["micro_step"] == k}
            assert got[("local_loss", "loss")] == pytest.approx(losses[-1], rel=1e-5)
            assert got[("local_norm", "layer.weight")] == pytest.approx(np.linalg.norm(acc_w) - prev_w, rel=1e-4, abs=1e-6)
            prev_w = np.linalg.norm(acc_w)
        device = {(r["kind"], r["name"]): r["value"] for r in records if r["micro_step"] is None}
        assert device == {("device_norm", "layer.weight"): pytest.approx(prev_w, rel=1e-5),
                          ("device_loss", "loss"): pytest.approx(np.mean(losses), rel=1e-5)}
        assert grad_norm == pytest.approx(np.sqrt(np.sum(acc_w ** 2) + np.sum(acc_b ** 2)), rel=1e-5)
        assert float(loss.asnumpy()) == pytest.approx(np.mean(losses), rel=1e-5)
        w, b = w - 0.1 * acc_w, b - 0.1 * acc_b
        np.testing.assert_allclose(net.weight.asnumpy(), w, rtol=1e-5)
    group.close()


def test_clipping_scales_to_max_norm(rng):
    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=1.0)
    x, y = _data(rng)
    before = net.weight.asnumpy().copy()
    _, grad_norm = AccumulatingTrainStep(net, optimizer, num_micro_steps=2, max_norm=0.01)(
        split_batch((Tensor(x), Tensor(y)), 2))
    moved = np.concatenate([(before - net.weight.asnumpy()).ravel(), -net.bias.asnumpy().ravel()])
    assert grad_norm > 0.01 and np.linalg.norm(moved) == pytest.approx(0.01, rel=1e-4)


def test_device_path_equals_host_path(rng):
    tensors = [Tensor(rng.normal(size=s).astype(np.float32)) for s in [(3, 4), (7,), (2, 2, 2)]]
    host, device = SquaredNorms(on_host=True), SquaredNorms(on_host=False)
    host.add("g", tensors)
    device.add("g", tensors)
    expected = [np.sum(t.asnumpy().astype(np.float64) ** 2) for t in tensors]
    np.testing.assert_allclose(host.results()["g"], expected, rtol=1e-12)
    np.testing.assert_allclose(device.results()["g"], expected, rtol=1e-5)


class _Exploding(Monitor):
    EVENTS = (MicroBatchLoss,)

    def __init__(self):
        self.calls = 0

    def reset(self):
        pass

    def on_event(self, event):
        pass

    def collect(self, step):
        self.calls += 1
        if step == 2:
            raise RuntimeError("boom")
        return []


def test_a_failing_monitor_is_dropped_and_training_goes_on(tmp_path, rng, caplog):
    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path), "train_state": {"device_loss": True}}}))
    exploding = _Exploding()
    group.monitors.append(exploding)
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=2, group=group)
    x, y = _data(rng)
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        for step in (1, 2, 3):
            train_step(split_batch((Tensor(x), Tensor(y)), 2))
            group.flush(step)
    group.close()
    assert exploding.calls == 2 and exploding not in group.monitors
    assert "_Exploding failed and is switched off" in caplog.text and "boom" in caplog.text
    steps = [r["step"] for r in read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")]
    assert steps == [1, 2, 3]  # the healthy train_state monitor keeps writing every step
