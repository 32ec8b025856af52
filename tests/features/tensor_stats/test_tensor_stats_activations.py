"""Activations (actv / actv_grad) on real MindSpore: every statistic of every row against a float64 numpy
recomputation of the forward and backward passes; specs; training mode; forward_only / backward_only."""
import glob
import logging
import os

import numpy as np
import pytest

from tests.support.activations_reference import activation_rows, output_root_for, run_config
from tests.support.msprobe_reference import K, NAMES, statistic
from mindmon.config import ConfigError
from mindmon.formats.msprobe_csv import read_csv
from mindmon.msprobe import parse_tensor_stats

OPS = ["min", "max", "mean", "norm", "zeros", "nans"]
RTOL = 1e-5


@pytest.fixture
def output_root(tmp_path, monkeypatch):
    return output_root_for(tmp_path, monkeypatch)


run = run_config


def rows_of(root):
    """{(prefix, step, micro_step, name): record} over the run's CSV files; each key once."""
    folders = glob.glob(str(root / "*-rank0-*"))
    assert len(folders) == 1, folders
    rows = {}
    for path in sorted(glob.glob(os.path.join(folders[0], "*.csv"))):
        if os.path.basename(path) == "stack_info.csv":
            continue
        for record in read_csv(path):
            key = (record.kind, record.step - 1, record.micro_step, record.name)
            assert key not in rows, f"{key} written twice"
            rows[key] = record
    return rows


def assert_statistics(rows, reference, ndigits=12):
    for key, record in rows.items():
        expected = reference[key]
        assert tuple(record.shape) == expected.shape and record.dtype == "Float32", key
        scale = np.abs(expected).max()
        for op, value in zip(record.ops, record.value):
            want = statistic(expected, op)
            tolerance = RTOL * (abs(want) if op != "mean" else scale) + 0.5 * 10 ** -ndigits + 1e-30
            assert abs(value - want) <= tolerance, f"{key} {op}: CSV {value!r}, numpy {want!r}"


def one_monitored_step(tmp_path, model, x, y, config):
    """One SGD step of `model` on the MSE loss of (x, y), with TrainerMon collecting `config` (ops norm and
    max, 12 digits)."""
    import json

    import mindspore as ms
    from mindspore import nn, value_and_grad

    from mindmon.msprobe import TrainerMon

    optimizer = nn.SGD(model.trainable_params(), 0.1)
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps({**config, "ops": ["norm", "max"], "ndigits": 12}))
    monitor = TrainerMon(str(path), params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    _, grads = value_and_grad(lambda a, b: nn.MSELoss()(model(a), b), None, optimizer.parameters)(ms.Tensor(x),
                                                                                                ms.Tensor(y))
    optimizer(grads)
    monitor.close()


def test_every_cell_forward_and_backward_matches_numpy(tmp_path, output_root):
    run(tmp_path, {"xy_distribution": True, "all_xy": True, "ops": OPS, "ndigits": 12})
    rows = rows_of(output_root)
    reference = activation_rows(2)
    assert set(rows) == set(reference)
    assert_statistics(rows, reference)
    # K = 2: micro-steps 0 and 1 of each step; the root's output gradient is d(loss / K)/do.
    assert {key[2] for key in rows} == set(range(K))
    assert ("actv_grad", 0, 0, ".input") not in rows and ("actv_grad", 0, 0, "fc1.input") not in rows
    with open(glob.glob(str(output_root / "*-rank0-*" / "actv_0-0.csv"))[0]) as file:
        assert file.readline().strip() == "vpp_stage,name,step,micro_step," + ",".join(OPS) + ",shape,dtype"


@pytest.mark.parametrize("waiting", [1, 300])
def test_statistics_taken_while_tensors_wait_match_numpy(tmp_path, output_root, monkeypatch, waiting):
    """Activations are held and their statistics taken when the held tensors reach `WAITING_ELEMENTS`: after
    every tensor (1), or several times a pass, across forward and gradient batches (300 elements)."""
    from mindmon.features.tensor_stats import monitor

    taken = []
    real = monitor.TensorStats._take_waiting
    monkeypatch.setattr(monitor, "WAITING_ELEMENTS", waiting)
    monkeypatch.setattr(monitor.TensorStats, "_take_waiting",
                        lambda stats: taken.append(stats._waiting_elements) or real(stats))
    run(tmp_path, {"xy_distribution": True, "all_xy": True, "ops": OPS, "ndigits": 12})
    rows = rows_of(output_root)
    reference = activation_rows(2)
    assert set(rows) == set(reference)
    assert_statistics(rows, reference)
    assert sum(1 for held in taken if held >= waiting) >= 2 * K


def test_an_output_that_is_also_its_parents_has_one_gradient_hook_and_both_rows(tmp_path, output_root, monkeypatch):
    """The root returns fc2's output tensor itself: one gradient hook on it serves both cells' rows (one
    read of one gradient), and both rows hold numpy's gradient of that output."""
    from mindmon.features.tensor_stats import activations

    watched = []
    register = activations.register_gradient_hook
    monkeypatch.setattr(activations, "register_gradient_hook",
                        lambda tensor, hook: watched.append(hook) or register(tensor, hook))
    run(tmp_path, {"xy_distribution": True, "all_xy": True, "ops": OPS, "ndigits": 12})
    # per forward: 3 output tensors (fc1's, act's, fc2's = the root's); the inputs go through markers
    assert [hook.__self__.rows for hook in watched[:3]] == [["fc1.output"], ["act.output"], ["fc2.output", ".output"]]
    rows = rows_of(output_root)
    reference = activation_rows(2)
    for micro_step in range(K):
        for name in ("fc2.output", ".output"):
            assert_statistics({key: rows[key] for key in [("actv_grad", 0, micro_step, name)]}, reference)


def test_specs_pick_what_they_name(tmp_path, output_root):
    config = {"xy_distribution": True, "ops": ["norm", "max"], "ndigits": 12,
              "targets": {"fc2": {"input": "tuple[1]:0", "output_grad": "tuple[1]:0"},
                          "act": {"output": "tensor"}}}
    run(tmp_path, config)
    rows = rows_of(output_root)
    reference = activation_rows(2)
    wanted = {("actv", "fc2.input"), ("actv_grad", "fc2.output"), ("actv", "act.output")}
    assert set(rows) == {k for k in reference if (k[0], k[3]) in wanted}
    assert_statistics(rows, reference)


def test_forward_only_and_backward_only(tmp_path, output_root, caplog):
    run(tmp_path, {"xy_distribution": True, "forward_only": True, "ops": ["norm"], "ndigits": 12}, steps=1)
    assert {key[0] for key in rows_of(output_root)} == {"actv"}
    for folder in glob.glob(str(output_root / "*")):
        for path in glob.glob(folder + "/*"):
            os.remove(path)
        os.rmdir(folder)
    run(tmp_path, {"xy_distribution": True, "backward_only": True, "ops": ["norm"], "ndigits": 12}, steps=1)
    assert {key[0] for key in rows_of(output_root)} == {"actv_grad"}
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        config = parse_tensor_stats({"xy_distribution": True, "forward_only": True, "backward_only": True})
    assert not config.collects_activations
    assert any("forward_only and backward_only are both true" in r.getMessage() for r in caplog.records)


def test_only_cells_in_training_mode(tmp_path, output_root, caplog):
    """A model never put in training mode (MindSpore cells start in eval mode): no rows, and that is said
    once, naming the fix; a model partly in eval mode collects the rest without that warning."""
    run(tmp_path, {"xy_distribution": True, "ops": ["norm"]}, steps=2, train_mode=False)
    assert not glob.glob(str(output_root / "*" / "actv*.csv"))
    said = [r.getMessage() for r in caplog.records if "every monitored cell ran in eval mode" in r.getMessage()]
    assert len(said) == 1 and "set_train(True)" in said[0]
    caplog.clear()
    # The model training, its fc2 in eval mode: every cell but fc2 has rows.
    run(tmp_path, {"xy_distribution": True, "ops": ["norm"], "ndigits": 12}, steps=1,
        prepare=lambda model: model.fc2.set_train(False))
    rows = rows_of(output_root)
    assert {key[3].split(".")[0] for key in rows} == {"", "fc1", "act"}
    assert_statistics(rows, activation_rows(1))
    assert not [r for r in caplog.records if "eval mode" in r.getMessage()]


def test_spec_mismatch_is_an_error_naming_cell_spec_and_what_it_got(tmp_path, output_root, caplog):
    config = {"xy_distribution": True, "ops": ["norm"], "ndigits": 12,
              "targets": {"fc1": {"input": "tuple[2]:0", "output": "tensor"}, "fc2": {"output": "tensor"}}}
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        run(tmp_path, config, steps=2)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors   # once, though the cell is called 4 times
    assert errors[0] == ("mindmon: targets.fc1.input is 'tuple[2]:0', but the cell 'fc1' got tuple[1] (Tensor); its "
                         "forward activations are not collected (fix the spec; print_struct shows what each cell gets)")
    rows = rows_of(output_root)   # fc2 is still collected, fc1 not at all
    assert {key[3] for key in rows} == {"fc2.output"} and len(rows) == 2 * K
    assert_statistics(rows, activation_rows(2))


@pytest.mark.parametrize("targets, message", [
    ({"fc1": {"input": "tupel[2]:0"}}, "targets.fc1.input: got 'tupel[2]:0'"),
    ({"fc1": {"input": "tuple[2]:2"}}, "targets.fc1.input: got 'tuple[2]:2'"),
    ({"fc1": {"inputs": "tensor"}}, "targets.fc1.inputs: unknown key"),
])
def test_bad_specs_are_config_errors(targets, message):
    with pytest.raises(ConfigError) as error:
        parse_tensor_stats({"xy_distribution": True, "targets": targets})
    assert str(error.value).startswith(message)


def test_spec_target_that_names_no_cell(tmp_path, output_root):
    with pytest.raises(ConfigError, match=r"^targets.fc9: names no cell"):
        run(tmp_path, {"xy_distribution": True, "targets": {"fc9": {"output": "tensor"}}}, steps=1)


def test_generate_xy_metrics_mid_step(tmp_path, output_root):
    """msprobe's generate_xy_metrics: the statistics gathered so far in the step, before the optimizer."""
    import mindspore as ms
    from mindspore import nn, value_and_grad

    from tests.support.activations_reference import make_relu_model
    from tests.support.msprobe_reference import batches
    from mindmon.msprobe import TrainerMon

    path = tmp_path / "monitor_config.json"
    path.write_text('{"xy_distribution": true, "ops": ["norm", "min"]}')
    model = make_relu_model()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), 0.1)
    monitor = TrainerMon(str(path), params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    x, y = batches()[0][0]
    value_and_grad(lambda a, b: nn.MSELoss()(model(a), b) / K, None, optimizer.parameters)(ms.Tensor(x),
                                                                                           ms.Tensor(y))
    actv, actv_grad = monitor.generate_xy_metrics()
    reference = activation_rows(1)
    assert set(actv) == {".input", ".output", "fc1.input", "fc1.output", "act.input", "act.output", "fc2.input",
                         "fc2.output"}
    for table, kind in ((actv, "actv"), (actv_grad, "actv_grad")):
        for name, values in table.items():
            for op, value in values.items():
                want = statistic(reference[(kind, 0, 0, name)], op)
                assert abs(value - want) <= RTOL * abs(want) + 1e-12, (kind, name, op, value, want)
    monitor.close()


def test_no_backward_hook_ever_and_cell_and_parameter_hooks_only_on_collected_steps(tmp_path, output_root):
    """MindSpore slows every step that has cell backward or parameter gradient hooks, even when they return
    at once, and a cell hook returning at once still costs its call. Activation gradients come from tensor
    hooks registered in a collected forward, so no cell ever has a backward hook; the cells' forward hooks
    and pre-hooks and the parameter hooks are attached for collected steps only. With step_interval 2,
    steps 0 and 2 are collected (and are right against numpy after the hooks came back)."""
    from tests.support.msprobe_reference import reference_run

    models, attached = [], []

    def count_after(step):
        cells = [cell for _, cell in models[0].cells_and_names()]
        attached.append((sum(len(cell._backward_hook) for cell in cells),
                         sum(len(param.hooks()) for param in models[0].trainable_params()),
                         sum(len(cell._forward_hook) for cell in cells),
                         sum(len(cell._forward_pre_hook) for cell in cells)))

    run(tmp_path, {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "ops": OPS, "ndigits": 12,
                   "step_interval": 2}, steps=3, between_steps=count_after, prepare=models.append)
    # (cell backward hooks, parameter hooks, forward hooks, forward pre-hooks) after each step: after step 0
    # (step 1 next, not collected) only the root's pre-hook that counts micro-steps (it stays for the run,
    # and passes the root's inputs through their markers); after step 1 (step 2 next) 4 parameters, the 4 cells'
    # forward hooks and the 3 non-root cells' pre-hooks; after step 2 the next step is not collected.
    assert attached == [(0, 0, 0, 1), (0, 4, 4, 4), (0, 0, 0, 1)]
    rows = rows_of(output_root)
    assert {key[1] for key in rows} == {0, 2}
    reference = {**activation_rows(3), **reference_run(steps=3)}
    assert {key for key in rows if key[0] == "actv_grad"} == {key for key in reference
                                                             if key[0] == "actv_grad" and key[1] in (0, 2)}
    assert {key for key in rows if key[0] == "grad_unreduced"} == {("grad_unreduced", step, None, name)
                                                                  for step in (0, 2) for name in NAMES}
    assert_statistics(rows, reference)


def test_input_gradient_is_the_cells_share_where_the_input_has_other_users(tmp_path, output_root):
    """h = fc1(x) feeds fc2 and also a residual (o = fc2(h) + h). fc2's `input` gradient is fc2's share of
    d loss / d h (d_o @ W2), not the total (d_o @ W2 + d_o) that fc1's `output` gradient is (what a cell
    backward hook gives as grad_input; a tensor hook on h would give the total). Against float64 numpy."""
    from mindspore import nn

    class Residual(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Dense(4, 6), nn.Dense(6, 6)

        def construct(self, x):
            h = self.fc1(x)
            return self.fc2(h) + h

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(5, 4)).astype(np.float32), rng.normal(size=(5, 6)).astype(np.float32)
    model = Residual()
    model.set_train(True)
    w1, b1, w2, b2 = (p.asnumpy().astype(np.float64) for p in model.trainable_params())
    one_monitored_step(tmp_path, model, x, y, {"xy_distribution": True, "backward_only": True})
    h = x.astype(np.float64) @ w1.T + b1
    o = h @ w2.T + b2 + h
    d_o = 2 * (o - y) / o.size
    expected = {".output": d_o, "fc2.output": d_o, "fc2.input": d_o @ w2, "fc1.output": d_o @ w2 + d_o}
    rows = rows_of(output_root)
    assert {key[3] for key in rows} == set(expected)   # x needs no gradient: no `input` row of fc1 or the root
    for (kind, step, micro_step, name), record in rows.items():
        assert (kind, step, micro_step) == ("actv_grad", 0, 0)
        for op, value in zip(record.ops, record.value):
            want = statistic(expected[name], op)
            assert abs(value - want) <= RTOL * abs(want), (name, op, value, want)



def test_an_input_autograd_does_not_track_gets_no_marker_and_no_gradient_row(tmp_path, output_root, monkeypatch):
    """o = scale(fc(x), s) with s a tensor made outside the gradient computation (as a model keeps an
    attention mask): where MindSpore tells which tensors its autograd tracks, s gets no `InputGradient`
    marker (an operation in the forward pass it does not need); its forward row stays, it has no gradient
    row, and the other input's gradient is numpy's."""
    import mindspore as ms
    from mindspore import nn

    from mindmon.compat import requires_grad_is_told
    from mindmon.features.tensor_stats import activations

    class Scale(nn.Cell):
        def construct(self, a, s):
            return a * s

    class Net(nn.Cell):
        def __init__(self, s):
            super().__init__()
            self.fc, self.scale, self.s = nn.Dense(4, 6), Scale(), ms.Tensor(s)

        def construct(self, x):
            return self.scale(self.fc(x), self.s)

    rng = np.random.default_rng(5)
    x, y, s = (rng.normal(size=shape).astype(np.float32) for shape in ((5, 4), (5, 6), (5, 6)))
    model = Net(s)
    model.set_train(True)
    w, b = (p.asnumpy().astype(np.float64) for p in model.trainable_params())
    marked = []
    made = activations.InputGradient
    monkeypatch.setattr(activations, "InputGradient",
                        lambda hooks, row, micro: marked.append(row) or made(hooks, row, micro))
    one_monitored_step(tmp_path, model, x, y, {"xy_distribution": True, "all_xy": True})
    h = x.astype(np.float64) @ w.T + b
    d_o = 2 * (h * s - y) / y.size
    told = requires_grad_is_told()
    assert told == (not ms.__version__.startswith("2.7"))
    assert ("scale.input_1" in marked) == (not told) and "scale.input_0" in marked
    rows = rows_of(output_root)
    assert {name for kind, _, _, name in rows if kind == "actv_grad"} == {".output", "scale.output", "scale.input_0",
                                                                          "fc.output"}
    expected = {("actv_grad", "scale.input_0"): d_o * s, ("actv_grad", "fc.output"): d_o * s,
                ("actv", "scale.input_1"): s.astype(np.float64)}
    for (kind, name), want_array in expected.items():
        record = rows[(kind, 0, 0, name)]
        for op, value in zip(record.ops, record.value):
            want = statistic(want_array, op)
            assert abs(value - want) <= RTOL * abs(want), (name, op, value, want)


def test_steps_ended_by_forwards_with_skipped_steps(tmp_path, output_root):
    """Without an optimizer (set_monitor(..., optimizer=None), as kj600's hook_modules), a step ends inside
    the root's forward pre-hook, while MindSpore runs the root's pre-hooks. With step_interval 2 over 4
    steps the run goes through, and steps 0 and 2 (the root's and every cell's gradients too) equal numpy."""
    rows, reference = _run_without_optimizer(tmp_path, output_root, {"step_interval": 2})
    assert set(rows) == {key for key in reference if key[1] in (0, 2)}
    assert_statistics(rows, reference)


def test_a_step_ended_by_forwards_detaches_every_hook_and_training_goes_on(tmp_path, output_root, caplog):
    """collect_times 1 without an optimizer: every activation hook is detached inside the root's forward
    pre-hook that ends step 0 (the root's own `input_grad` goes through the micro-step counter, so no
    pre-hook of the root is removed while MindSpore runs them). Nothing is logged as failed, no hook is
    left on any cell but the counter, and step 0 equals numpy."""
    hooks_left = []
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        rows, reference = _run_without_optimizer(tmp_path, output_root, {"collect_times": 1}, hooks_left)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert hooks_left == [1]   # the root's micro-step counter
    assert set(rows) == {key for key in reference if key[1] == 0}
    assert_statistics(rows, reference)


def _run_without_optimizer(tmp_path, output_root, options: dict, hooks_left: list = None):
    import json

    from tests.support.activations_reference import train
    from mindmon.msprobe import TrainerMon

    class WithoutOptimizer(TrainerMon):
        def hook_modules(self, model, grad_acc_steps):
            self.set_monitor(model, grad_acc_steps, None)

    def count_hooks(model):
        if hooks_left is not None:
            cells = [cell for _, cell in model.cells_and_names()]
            hooks_left.append(sum(len(c._forward_hook) + len(c._forward_pre_hook) + len(c._backward_hook)
                                  for c in cells))

    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps({"xy_distribution": True, "all_xy": True, "ops": OPS, "ndigits": 12, **options}))
    models = []
    monitor = train(lambda: WithoutOptimizer(str(path), params_have_main_grad=False), 4, optimizer_to_monitor=False,
                    prepare=models.append)
    count_hooks(models[0])
    monitor.close()
    return rows_of(output_root), activation_rows(3)   # step 3's forward ends step 2 (the reference: 3 steps)


def test_rows_of_a_value_holding_several_tensors_are_numbered_by_position():
    """`<cell>.input_<i>`: i is the element's place in the hook's tuple, non-tensors and None gradients are
    skipped without renumbering the rest; a tuple of one tensor is the plain name; gradient rows use the
    names of the tensors they are gradients of; the root cell's name is empty."""
    import mindspore as ms
    from mindmon.features.tensor_stats.activations import BACKWARD_KEYS, FORWARD_KEYS, CellValues

    a, b, c = (ms.Tensor(np.full(2, v, np.float32)) for v in (1.0, 2.0, 3.0))
    forward = CellValues("block", {"input": None, "output": None}, FORWARD_KEYS)
    rows = forward.pick(((a, 7, b), (c,)))
    assert [name for name, _ in rows] == ["block.input_0", "block.input_2", "block.output"]
    assert [tensor is want for (_, tensor), want in zip(rows, (a, b, c))] == [True] * 3
    # one level is unwrapped: a tuple holding one tuple of tensors, or one number, has no row
    assert forward.pick((((a, b),), (7,))) == []
    backward = CellValues("", {"output_grad": None, "input_grad": None}, BACKWARD_KEYS)
    rows = backward.pick(((None, a), b))
    assert [(name, tensor is want) for (name, tensor), want in zip(rows, (b, a))] == [(".output", True),
                                                                                     (".input_1", True)]
