"""Loss scale from MindSpore's own managers and cells: `mindspore.amp.DynamicLossScaleManager` /
`FixedLossScaleManager` handed to `AccumulatingTrainStep`, and `mindspore.train.Model` training a
`nn.TrainOneStepWithLossScaleCell` built from a manager's update cell, with mindmon's
`ModelMonitorCallback`. A float16 model whose loss scale starts far too high overflows on purpose; every
expected value is read from MindSpore (the cell's `scale_sense` Parameter, the manager's
`get_loss_scale()`, whether the parameters moved), never from mindmon.

On CPU, MindSpore 2.9 runs neither as such: Model refuses a dynamic manager, and the cell's overflow check
is an Ascend kernel. The first two tests pin those facts (docs/semantics.md quotes them); the Model test
then uses `CpuOverflowCheck`, the cell with only its overflow-status method replaced by the CPU
equivalent (`not amp.all_finite(grads)`, what the cell computes on GPU with its own ops).
"""
import numpy as np
import pytest

from tests.support.jsonl import read_jsonl
from mindmon import build_group
from mindmon.features import parse_sections
from tests.features.loss_scale.test_loss_scale import FACTOR, START_SCALE, STEPS, WINDOW, float16_model

pytestmark = pytest.mark.ms27   # MindSpore's own managers and cell: run on 2.7 and 2.10 too


def _data():
    data = np.random.default_rng(0)
    return data.standard_normal((8, 4)).astype(np.float16), data.standard_normal((8, 3)).astype(np.float32)


def _loss_cell(net):
    import mindspore as ms
    from mindspore import nn, ops

    class MeanSquare(nn.Cell):   # a float32 loss of the float16 output: the scale overflows the backward only
        def __init__(self):
            super().__init__()
            self.net = net

        def construct(self, x, y):
            return ops.mean((self.net(x).astype(ms.float32) - y) ** 2)

    return MeanSquare()


def _group(tmp_path):
    return build_group(parse_sections({"monitor": {"output_dir": str(tmp_path / "out"),
                                                   "loss_scale": {"enabled": True}}}))


def _rows(tmp_path, kind):
    rows = read_jsonl(tmp_path / "out" / "rank_0" / "metrics.jsonl")
    return [r["value"] for r in sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["step"])]


def _parameters(net):
    return [p.asnumpy().copy() for p in net.trainable_params()]


def _cpu_overflow_check_cell():
    from mindspore import amp, nn, ops

    class CpuOverflowCheck(nn.TrainOneStepWithLossScaleCell):
        """TrainOneStepWithLossScaleCell with its overflow-status op replaced by a CPU one; nothing else."""

        def get_overflow_status(self, status, compute_output):
            return ops.logical_not(amp.all_finite(compute_output))

    return CpuOverflowCheck


def test_model_refuses_a_dynamic_manager_on_cpu():
    from mindspore import amp
    from mindspore.train import Model

    net, optimizer = float16_model()
    with pytest.raises(ValueError, match=r"Only `loss_scale_manager=None` or "
                                         r"`loss_scale_manager=FixedLossScaleManager\(drop_overflow_update=False\)`"
                                         r"are supported on device `CPU`"):
        Model(_loss_cell(net), optimizer=optimizer,
              loss_scale_manager=amp.DynamicLossScaleManager(START_SCALE, FACTOR, WINDOW))


def test_the_cell_s_own_overflow_check_has_no_cpu_kernel():
    from mindspore import Tensor, amp, nn

    net, optimizer = float16_model()
    manager = amp.DynamicLossScaleManager(START_SCALE, FACTOR, WINDOW)
    cell = nn.TrainOneStepWithLossScaleCell(_loss_cell(net), optimizer, scale_sense=manager.get_update_cell())
    x, y = _data()
    with pytest.raises(RuntimeError, match=r"Unsupported op \[NPUGetFloatStatusV2\] on CPU"):
        cell(Tensor(x), Tensor(y))


def _train_with_model(tmp_path, update_cell):
    """Model.train over STEPS copies of one batch; the test's own callback reads, after mindmon's, the cell's
    scale Parameter and whether the parameters moved. Returns [(scale after the step, skipped)]."""
    import mindspore.dataset as ds
    from mindspore.train import Callback, Model

    from mindmon.callbacks import ModelMonitorCallback

    net, optimizer = float16_model()
    cell = _cpu_overflow_check_cell()(_loss_cell(net), optimizer, scale_sense=update_cell)
    x, y = _data()
    dataset = ds.NumpySlicesDataset({"x": np.stack([x] * STEPS), "y": np.stack([y] * STEPS)}, shuffle=False)
    seen = []

    class Reader(Callback):
        def on_train_step_begin(self, run_context):
            self.before = _parameters(net)

        def on_train_step_end(self, run_context):
            unchanged = all(np.array_equal(a, b) for a, b in zip(self.before, _parameters(net)))
            seen.append((float(cell.scale_sense.asnumpy()), unchanged))

    Model(cell).train(1, dataset, callbacks=[ModelMonitorCallback(_group(tmp_path)), Reader()],
                      dataset_sink_mode=False)
    return seen


def test_model_with_a_dynamic_manager_s_cell_records_what_the_cell_did(tmp_path):
    from mindspore import amp

    seen = _train_with_model(tmp_path, amp.DynamicLossScaleManager(START_SCALE, FACTOR, WINDOW).get_update_cell())
    skipped = [s for _, s in seen]
    assert sum(skipped) >= 3 and not all(skipped)   # the run overflows, and recovers
    scales = [scale for scale, _ in seen]
    assert _rows(tmp_path, "loss_scale") == scales
    assert _rows(tmp_path, "update_skipped") == [float(s) for s in skipped]
    assert _rows(tmp_path, "overflow") == [float(s) for s in skipped]
    assert _rows(tmp_path, "skipped_steps") == list(np.cumsum(skipped).astype(float))
    before = [START_SCALE] + scales[:-1]
    assert [scale == b / FACTOR for scale, b in zip(scales, before)] == skipped   # halved exactly when skipped
    assert len(_rows(tmp_path, "loss")) == STEPS


def test_model_with_a_fixed_manager_s_cell_skips_every_overflowing_step(tmp_path):
    from mindspore import amp

    seen = _train_with_model(tmp_path, amp.FixedLossScaleManager(START_SCALE, drop_overflow_update=True)
                             .get_update_cell())
    assert seen == [(START_SCALE, True)] * STEPS   # 2**20 overflows float16 at every step; the scale stays
    assert _rows(tmp_path, "loss_scale") == [START_SCALE] * STEPS
    assert _rows(tmp_path, "skipped_steps") == [float(s) for s in range(1, STEPS + 1)]


def _accumulate(tmp_path, manager):
    """AccumulatingTrainStep given the manager itself. Returns [(manager's scale after the step, skipped)]."""
    from mindmon.loop.step import AccumulatingTrainStep
    from mindspore import Tensor

    net, optimizer = float16_model()
    group = _group(tmp_path)
    train_step = AccumulatingTrainStep(_loss_cell(net), optimizer, 2, group, loss_scaler=manager)
    x, y = map(Tensor, _data())
    group.setup(max_steps=STEPS)
    seen = []
    for step in range(1, STEPS + 1):
        before = _parameters(net)
        loss, grad_norm = train_step([(x[:4], y[:4]), (x[4:], y[4:])])
        seen.append((float(manager.get_loss_scale()),
                     all(np.array_equal(a, b) for a, b in zip(before, _parameters(net)))))
        group.flush(step, loss=loss, grad_norm=grad_norm)
    group.close()
    return seen


def test_accumulating_train_step_takes_a_dynamic_loss_scale_manager(tmp_path):
    import mindspore as ms
    from mindspore import amp

    assert ms.DynamicLossScaleManager is amp.DynamicLossScaleManager   # one class under both names
    seen = _accumulate(tmp_path, ms.DynamicLossScaleManager(START_SCALE, FACTOR, WINDOW))
    skipped = [s for _, s in seen]
    scales = [scale for scale, _ in seen]
    assert sum(skipped) >= 3 and not all(skipped)
    assert _rows(tmp_path, "loss_scale") == scales
    assert _rows(tmp_path, "update_skipped") == [float(s) for s in skipped]
    assert _rows(tmp_path, "skipped_steps")[-1] == sum(skipped)
    before = [START_SCALE] + scales[:-1]
    assert [scale == b / FACTOR for scale, b in zip(scales, before)] == skipped
    assert all(np.isfinite(_rows(tmp_path, "loss")))   # the loss recorded is the unscaled one


def test_accumulating_train_step_takes_a_fixed_loss_scale_manager(tmp_path):
    from mindspore import amp

    seen = _accumulate(tmp_path, amp.FixedLossScaleManager(64.0))
    assert seen == [(64.0, False)] * STEPS   # 64 does not overflow float16 here: every update applied
    assert _rows(tmp_path, "loss_scale") == [64.0] * STEPS
    assert _rows(tmp_path, "skipped_steps") == [0.0] * STEPS


def test_model_with_a_fixed_manager_that_never_drops_has_no_overflow_check_and_writes_the_loss(tmp_path):
    """`FixedLossScaleManager(drop_overflow_update=False)`, the one manager Model takes on CPU, builds a plain
    TrainOneStepCell: no overflow is checked, so no loss-scale records; the step's loss is written."""
    import mindspore.dataset as ds
    from mindspore import amp
    from mindspore.train import Callback, Model

    from mindmon.callbacks import ModelMonitorCallback

    net, optimizer = float16_model()
    x, y = _data()
    dataset = ds.NumpySlicesDataset({"x": np.stack([x] * 3), "y": np.stack([y] * 3)}, shuffle=False)
    losses = []

    class Reader(Callback):   # the loss of the weights the step started from, in numpy
        def on_train_step_begin(self, run_context):
            weight, bias = (p.asnumpy().astype(np.float64) for p in net.trainable_params())
            losses.append(float(np.mean((x.astype(np.float64) @ weight.T + bias - y) ** 2)))

    model = Model(_loss_cell(net), optimizer=optimizer, loss_scale_manager=amp.FixedLossScaleManager(64.0, False))
    model.train(1, dataset, callbacks=[Reader(), ModelMonitorCallback(_group(tmp_path))], dataset_sink_mode=False)
    assert _rows(tmp_path, "loss") == pytest.approx(losses, rel=1e-2)
    assert len(losses) == 3 and losses[0] != losses[-1]   # the weights did move
    assert _rows(tmp_path, "loss_scale") == [] and _rows(tmp_path, "skipped_steps") == []
