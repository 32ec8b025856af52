"""The step's own values (loss, grad_norm, learning_rate, samples, max_norm) in a plain loop through
`group.flush(step, ...)` and on the MindFormers Trainer; the report's clipping threshold; parameter
names from the model; the optimizer contract."""
import logging
import uuid

import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

from tests.support.jsonl import read_jsonl
from tests.support.demo_trainer import train, trainer_config
from mindmon import AccumulatingTrainStep, build_group, parameter_names, parse_sections, split_batch
from mindmon.analysis.report import THRESHOLD_LABEL, loss_plot
from mindmon.formats.jsonl import read_records
from tests.support.scripts.plain_loop_job import Regression


def threshold_lines(records, micro_steps):
    figure = loss_plot(records, micro_steps)
    return [line for ax in figure.axes for line in ax.get_lines() if line.get_label() == THRESHOLD_LABEL]


def numpy_step(w, b, x, y, micro_steps):
    """(mean loss, gradient of w, gradient of b) of the regression's K micro-batches, each of loss_k / K."""
    losses, grad_w, grad_b = [], np.zeros_like(w), np.zeros_like(b)
    size = len(x) // micro_steps
    for k in range(micro_steps):
        xs, ys = x[k * size:(k + 1) * size].astype(np.float64), y[k * size:(k + 1) * size].astype(np.float64)
        diff = xs @ w + b - ys
        losses.append(np.mean(diff ** 2))
        grad_w += xs.T @ diff * 2 / diff.size / micro_steps
        grad_b += diff.sum(axis=0) * 2 / diff.size / micro_steps
    return np.mean(losses), grad_w, grad_b


@pytest.mark.parametrize("max_norm", [0.0, 0.5])
def test_flush_writes_the_step_values_and_max_norm_only_when_clipping(tmp_path, rng, max_norm):
    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path), "train_state": {"device_loss": True}}}),
                        parameter_names=parameter_names(net, optimizer))
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=2, group=group, max_norm=max_norm)
    group.setup(max_steps=3, global_batch_size=8)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype(np.float32)
    w, b = np.full((3, 1), 0.5), np.zeros(1)
    for step in (1, 2, 3):
        loss, grad_norm = train_step(split_batch((Tensor(x), Tensor(y)), 2))
        group.flush(step, loss=loss, grad_norm=grad_norm, learning_rate=0.1)
        want_loss, grad_w, grad_b = numpy_step(w, b, x, y, 2)
        norm = np.sqrt(np.sum(grad_w ** 2) + np.sum(grad_b ** 2))
        got = {r["kind"]: r for r in read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
               if r["step"] == step and r["micro_step"] is None}
        assert got["loss"]["value"] == pytest.approx(want_loss, rel=1e-5) and got["loss"]["name"] == "loss"
        assert got["grad_norm"]["value"] == pytest.approx(norm, rel=1e-5) and got["grad_norm"]["name"] == "global"
        assert (got["learning_rate"]["name"], got["learning_rate"]["value"]) == ("lr", 0.1)
        assert got["samples"]["value"] == 8.0 * step
        assert (got["max_norm"]["value"] if "max_norm" in got else None) == (max_norm or None)
        scale = max_norm / norm if 0 < max_norm < norm else 1.0
        w, b = w - 0.1 * scale * grad_w, b - 0.1 * scale * grad_b
    group.close()
    assert norm > 0.5   # every step clipped when clipping is on: the threshold line means something
    lines = threshold_lines(read_records(str(tmp_path / "rank_0" / "metrics.jsonl")), 2)
    if max_norm:
        assert len(lines) == 1 and list(lines[0].get_ydata()) == [0.5] * 3 and list(lines[0].get_xdata()) == [1, 2, 3]
    else:
        assert lines == []


def test_a_step_value_that_is_not_a_number_is_logged_once_and_the_step_is_written(tmp_path, caplog):
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path), "train_state": {"device_loss": True}}}))
    group.setup()
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        for step in (1, 2):
            group.record("device_loss", 2.0 * step)
            group.flush(step, loss="not a number", grad_norm=1.0)
    group.close()
    assert caplog.text.count("could not record the step's loss/grad norm/lr") == 1
    assert [(r["step"], r["kind"]) for r in read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")] == \
        [(1, "device_loss"), (2, "device_loss")]


class _UuidNamed(nn.Cell):
    """Parameters whose `name` is a unique id, as in mindnlp's modules; the model knows them as fc.* and out."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(3, 2)
        for parameter in self.fc.get_parameters():
            parameter.name = uuid.uuid4().hex
        self.out = Parameter(Tensor(np.ones((2, 1), np.float32)), name=uuid.uuid4().hex)

    def construct(self, x):
        return ops.matmul(self.fc(x), self.out)


class _TorchStyleModule:
    """Only `named_parameters()`, as a torch-style module has."""

    def __init__(self, pairs):
        self.pairs = pairs

    def named_parameters(self):
        return iter(self.pairs)


def test_parameter_names_are_the_models_in_the_optimizers_order():
    net = _UuidNamed()
    model_order = [name for name, _ in net.parameters_and_names()]
    assert sorted(model_order) == ["fc.bias", "fc.weight", "out"]
    reordered = [net.out, net.fc.bias, net.fc.weight]
    optimizer = nn.SGD(reordered, learning_rate=0.1)
    assert parameter_names(net, optimizer) == ["out", "fc.bias", "fc.weight"]
    stray = Parameter(Tensor(np.zeros(1, np.float32)), name="stray")   # held by the optimizer, not the model
    assert parameter_names(net, nn.SGD(reordered + [stray], learning_rate=0.1))[-1] == "stray"
    module = _TorchStyleModule([("layers.0.weight", net.fc.weight), ("layers.0.bias", net.fc.bias)])
    assert parameter_names(module, nn.SGD([net.fc.bias, net.fc.weight], learning_rate=0.1)) == \
        ["layers.0.bias", "layers.0.weight"]


class _TorchStyleOptimizer:
    def __init__(self, params):
        self.param_groups = [{"params": list(params)}]

    def zero_grad(self):
        pass

    def step(self):
        pass


def test_a_torch_style_optimizer_is_refused_when_the_train_step_is_built():
    net = Regression()
    with pytest.raises(TypeError, match=r"^optimizer: got .*_TorchStyleOptimizer, which has no `.parameters` "
                                        r".*torch-style optimizers \(param_groups, step\(\)\) are not supported$"):
        AccumulatingTrainStep(net, _TorchStyleOptimizer(net.trainable_params()), num_micro_steps=2)


def test_the_trainer_writes_max_norm_from_training_max_norm(tmp_path):
    """MindFormers 1.9's PyNative Trainer clips at `training.max_norm`; the run's JSONL says so (a value
    other than the default 1.0, so it is read from the config). Clipping off is the same code path as
    the plain loop's, tested above."""
    config = trainer_config(tmp_path, steps=2, monitor={"train_state": {"device_loss": True}})
    config["training"]["max_norm"] = 0.25
    train(config)
    rows = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    grad_norms = {r["step"]: r["value"] for r in rows if r["kind"] == "grad_norm"}
    thresholds = {r["step"]: r["value"] for r in rows if r["kind"] == "max_norm"}
    assert sorted(grad_norms) == [1, 2] and thresholds == {1: 0.25, 2: 0.25}
    lines = threshold_lines(read_records(str(tmp_path / "rank_0" / "metrics.jsonl")), 4)
    assert [list(line.get_ydata()) for line in lines] == [[0.25, 0.25]]
