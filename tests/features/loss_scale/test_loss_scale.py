"""Loss scale and overflow (mindmon/features/loss_scale): a float16 model whose loss scale starts far too
high, so its first steps overflow on purpose. Every expected value is read from MindSpore's own scaler
(its `scale_value` Parameter, `amp.all_finite`, the parameters before and after the step), never from
mindmon's code."""
import json
import logging

import warnings

import numpy as np
import pytest

from tests.support.jsonl import read_jsonl
from mindmon import build_group
from mindmon.config import ConfigError
from mindmon.features import parse_sections

STEPS = 10
START_SCALE, FACTOR, WINDOW = 2.0 ** 20, 2, 3


def float16_model():
    import mindspore as ms
    from mindspore import nn

    ms.set_seed(0)
    net = nn.Dense(4, 3).to_float(ms.float16)   # float16 activations: a scale of 2**20 overflows them
    return net, nn.SGD(net.trainable_params(), 0.01)


def _batch():
    from mindspore import Tensor

    data = np.random.default_rng(0)
    return (Tensor(data.standard_normal((8, 4)).astype(np.float16)),
            Tensor(data.standard_normal((8, 3)).astype(np.float32)))


def _mse(net):
    import mindspore as ms
    from mindspore import ops

    return lambda x, y: ops.mean((net(x).astype(ms.float32) - y) ** 2)


def _group(tmp_path, rules=None):
    monitor = {"output_dir": str(tmp_path / "out"), "loss_scale": {"enabled": True},
               "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    if rules:
        monitor["alert"] = {"rules": rules}
    return build_group(parse_sections({"monitor": monitor}))


def _rows(tmp_path, kind):
    rows = [r for r in read_jsonl(tmp_path / "out" / "rank_0" / "metrics.jsonl") if r["kind"] == kind]
    return {r["step"]: r["value"] for r in rows}


def _scale(scaler) -> float:
    return float(scaler.scale_value.asnumpy())


def _parameters(optimizer):
    return [p.asnumpy().copy() for p in optimizer.parameters]


def _plain_amp_loop(tmp_path, rules=None):
    """MindSpore's documented amp recipe: scale, unscale, all_finite, adjust, update only when finite.
    Returns what the scaler itself did at every step: (scale after adjust, gradients finite)."""
    from mindspore import amp, value_and_grad

    net, optimizer = float16_model()
    scaler = amp.DynamicLossScaler(START_SCALE, FACTOR, WINDOW)
    loss_fn = _mse(net)
    grad_fn = value_and_grad(lambda x, y: scaler.scale(loss_fn(x, y)), None, optimizer.parameters)
    group, (x, y), seen = _group(tmp_path, rules), _batch(), []
    group.setup(max_steps=STEPS)
    for step in range(1, STEPS + 1):
        loss, grads = grad_fn(x, y)
        grads = scaler.unscale(grads)
        finite = amp.all_finite(grads)
        scaler.adjust(finite)
        if finite:
            optimizer(grads)
        seen.append((_scale(scaler), bool(finite)))
        group.record("loss_scale", scaler, {"overflow": not finite})
        group.flush(step, loss=scaler.unscale(loss))
    group.close()
    return seen


def test_a_plain_amp_loop_records_what_the_dynamic_scaler_did(tmp_path):
    seen = _plain_amp_loop(tmp_path)
    overflowed = [not finite for _, finite in seen]
    assert sum(overflowed) >= 3 and not all(overflowed)   # the run does overflow, and recovers
    scales = _rows(tmp_path, "loss_scale")
    assert [scales[s] for s in range(1, STEPS + 1)] == [scale for scale, _ in seen]
    assert [_rows(tmp_path, "overflow")[s] for s in range(1, STEPS + 1)] == [float(o) for o in overflowed]
    assert [_rows(tmp_path, "update_skipped")[s] for s in range(1, STEPS + 1)] == [float(o) for o in overflowed]
    assert [_rows(tmp_path, "skipped_steps")[s] for s in range(1, STEPS + 1)] == list(
        np.cumsum(overflowed).astype(float))
    before = [START_SCALE] + [scale for scale, _ in seen[:-1]]
    for step, (scale, finite) in enumerate(seen, start=1):   # each overflow halved the scale the step used
        if not finite:
            assert scales[step] == before[step - 1] / FACTOR


def test_tensorboard_has_megatron_loss_scale_tag_and_the_flags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = _plain_amp_loop(tmp_path)
    events = EventAccumulator(str(tmp_path / "tb" / "rank_0"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss-scale")] == [
        (step, scale) for step, (scale, _) in enumerate(seen, start=1)]
    assert [e.value for e in events.Scalars("update_skipped")] == [float(not finite) for _, finite in seen]
    assert events.Scalars("skipped_steps")[-1].value == sum(not finite for _, finite in seen)


def test_the_log_line_says_it_and_parse_log_reads_it_back(tmp_path, caplog):
    from mindmon.analysis.parse_log import LogParser

    with caplog.at_level(logging.INFO, logger="mindmon"):
        seen = _plain_amp_loop(tmp_path)
    lines = [line for r in caplog.records for line in r.getMessage().splitlines() if '"update_skipped"' in line]
    scale, finite = seen[0]
    assert lines[0] == (f'{{ "step": 1, "loss_scale": {scale!r}, "overflow": {json.dumps(not finite)}, '
                        f'"update_skipped": {json.dumps(not finite)}, "skipped_steps": {int(not finite)} }}')
    parser = LogParser()
    records = [r for line in lines for r in parser.feed(line)]
    assert parser.counts.malformed == 0
    assert [r.value for r in records if r.kind == "loss_scale"] == [s for s, _ in seen]
    assert [r.value for r in records if r.kind == "overflow"] == [float(not f) for _, f in seen]


def test_skipped_steps_rule_fires_at_the_nth_skip_in_a_row(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        seen = _plain_amp_loop(tmp_path, rules=[{"rule_name": "SkippedSteps", "args": {"threshold": 3}}])
    in_a_row, expected = 0, []
    for step, (_, finite) in enumerate(seen, start=1):
        in_a_row = 0 if finite else in_a_row + 1
        if in_a_row == 3:
            expected.append(step)
    assert expected   # the run skips 3 in a row at least once
    fired = [r.getMessage() for r in caplog.records if "Rule SkippedSteps" in r.getMessage()]
    assert [int(m.split(" at step ")[1].split()[0]) for m in fired] == expected


def test_accumulating_train_step_scales_skips_and_adjusts(tmp_path):
    """mindmon's own step with a DynamicLossScaler: the skipped steps are those where the parameters did
    not move, the scale is the scaler's own after each step."""
    from mindspore import amp, value_and_grad

    from mindmon.loop.step import AccumulatingTrainStep

    net, optimizer = float16_model()
    scaler = amp.DynamicLossScaler(START_SCALE, FACTOR, WINDOW)
    group = _group(tmp_path)
    train_step = AccumulatingTrainStep(_mse(net), optimizer, 2, group, loss_scaler=scaler)
    x, y = _batch()
    group.setup(max_steps=STEPS)
    plain_grads = value_and_grad(_mse(net), None, optimizer.parameters)   # no scale: float16 does not overflow
    scales, unchanged = [], []
    for step in range(1, STEPS + 1):
        before = _parameters(optimizer)
        reference = np.sqrt(sum(float((g.asnumpy().astype(np.float64) ** 2).sum()) for g in plain_grads(x, y)[1]))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)   # an overflowed step's inf + -inf warns nobody
            loss, grad_norm = train_step([(x[:4], y[:4]), (x[4:], y[4:])])
        if np.isfinite(grad_norm):   # the gradients the optimizer got are unscaled
            assert grad_norm == pytest.approx(reference, rel=1e-2)
        unchanged.append(all(np.array_equal(a, b) for a, b in zip(before, _parameters(optimizer))))
        scales.append(_scale(scaler))
        group.flush(step, loss=loss, grad_norm=grad_norm)
    group.close()
    assert sum(unchanged) >= 3 and not all(unchanged)
    assert [_rows(tmp_path, "loss_scale")[s] for s in range(1, STEPS + 1)] == scales
    assert [_rows(tmp_path, "update_skipped")[s] for s in range(1, STEPS + 1)] == [float(u) for u in unchanged]
    assert _rows(tmp_path, "skipped_steps")[STEPS] == sum(unchanged)
    for k in range(1, STEPS):   # the scaler halved exactly at the skipped steps
        assert (scales[k] == scales[k - 1] / FACTOR) == (unchanged[k] and scales[k - 1] > 1)


def test_dynamic_loss_scale_update_cell_and_its_parameter(tmp_path):
    """MindSpore's update cell, driven as TrainOneStepWithLossScaleCell drives it (that cell's overflow check
    is an Ascend kernel, absent on CPU): the cell writes the new scale into the Parameter the loop hands it."""
    import mindspore as ms
    from mindspore import Parameter, Tensor, amp, nn, value_and_grad

    net, optimizer = float16_model()
    manager = nn.DynamicLossScaleUpdateCell(loss_scale_value=START_SCALE, scale_factor=FACTOR, scale_window=WINDOW)
    scale = Parameter(Tensor(START_SCALE, ms.float32), name="loss_scale")
    loss_fn = _mse(net)
    grad_fn = value_and_grad(lambda x, y: loss_fn(x, y) * scale, None, optimizer.parameters)
    group, (x, y), seen = _group(tmp_path), _batch(), []
    group.setup()
    for step in range(1, STEPS + 1):
        _, grads = grad_fn(x, y)
        grads = tuple(g / scale for g in grads)
        overflow = manager(scale, ~amp.all_finite(grads))
        if not overflow:
            optimizer(grads)
        seen.append((float(scale.asnumpy()), bool(overflow.asnumpy())))
        group.record("loss_scale", scale, {"overflow": overflow})
        group.flush(step)
    group.close()
    assert 3 <= sum(o for _, o in seen) < STEPS
    assert [_rows(tmp_path, "loss_scale")[s] for s in range(1, STEPS + 1)] == [s for s, _ in seen]
    assert [_rows(tmp_path, "overflow")[s] for s in range(1, STEPS + 1)] == [float(o) for _, o in seen]


def test_a_dynamic_update_cell_is_refused_with_one_line_and_training_goes_on(tmp_path, caplog):
    from mindspore import nn

    group = _group(tmp_path)
    group.setup()
    manager = nn.DynamicLossScaleUpdateCell(loss_scale_value=1024.0, scale_factor=2, scale_window=10)
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        group.record("loss_scale", manager, {"overflow": False})
        group.flush(1, loss=1.0)
        group.record("loss_scale", manager, {"overflow": False})
        group.flush(2, loss=1.0)
    errors = [r for r in caplog.records if "LossScaleMonitor failed" in r.getMessage()]
    assert len(errors) == 1 and "get_loss_scale() is its initial scale" in str(errors[0].exc_info[1])
    assert _rows(tmp_path, "loss") == {1: 1.0, 2: 1.0}
    group.close()


@pytest.mark.parametrize("section, message", [
    ({"enabled": "yes"}, "monitor.loss_scale.enabled"),
    ({"enable": True}, "monitor.loss_scale.enable: unknown key"),
])
def test_bad_section_is_one_clean_line(section, message):
    with pytest.raises(ConfigError, match=message):
        parse_sections({"monitor": {"loss_scale": section}})


@pytest.mark.parametrize("threshold", [0, 2.5, "3"])
def test_skipped_steps_threshold_is_a_positive_int(threshold):
    with pytest.raises(ConfigError, match=r"monitor\.alert\.rules\[0\]\.args\.threshold"):
        parse_sections({"monitor": {"alert": {"rules": [{"rule_name": "SkippedSteps",
                                                         "args": {"threshold": threshold}}]}}})


def test_mindformers_trainer_records_the_skipped_updates(tmp_path):
    """The MindFormers PyNative Trainer runs mindmon's training step: a model whose weight holds an inf has
    non-finite gradients at every step, so every update is skipped (its other parameters never move)."""
    from tests.support.demo_trainer import make_model, train, trainer_config

    from mindspore import Tensor

    model = make_model()
    poisoned = model.parameters_dict()["decoder.final_layernorm.bias"]   # every token's hidden state goes inf
    values = poisoned.asnumpy().copy()
    values.flat[0] = np.inf
    poisoned.set_data(Tensor(values))
    others = {p.name: p.asnumpy().copy() for p in model.trainable_params() if p.name != poisoned.name}
    train(trainer_config(tmp_path / "out", steps=2, monitor={"loss_scale": {"enabled": True}}), model)
    moved = [name for name, before in others.items()
             if not np.array_equal(before, model.parameters_dict()[name].asnumpy())]
    assert moved == []
    assert _rows(tmp_path, "update_skipped") == {1: 1.0, 2: 1.0}
    assert _rows(tmp_path, "skipped_steps") == {1: 1.0, 2: 2.0}
    assert _rows(tmp_path, "loss_scale") == {}   # no scaler in that loop



def test_the_report_marks_the_skipped_steps_on_the_loss_plot(tmp_path):
    from mindmon.analysis.report import SKIPPED_LABEL, loss_plot
    from mindmon.formats.jsonl import read_records

    seen = _plain_amp_loop(tmp_path)
    figure = loss_plot(read_records(str(tmp_path / "out" / "rank_0" / "metrics.jsonl")), 1)
    lines = [line for ax in figure.axes for line in ax.get_lines()]
    marked = [line.get_xdata()[0] for line in lines if line.get_label() in (SKIPPED_LABEL, "_nolegend_")]
    assert marked == [step for step, (_, finite) in enumerate(seen, start=1) if not finite]
