"""The device path (`on_host=False`: statistics reduced by MindSpore operations, as off the CPU) takes the
same number of operations at a collection point whatever the number of tensors, and gives the numbers
numpy gives. The operations are counted by MindSpore's own profiler (every kernel it launches); run on
CPU, where the device path's operations are real MindSpore kernels."""
import math
from collections import Counter

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
from mindmon.features.tensor_stats.accumulate import GradientSums
from mindmon.features.tensor_stats.monitor import TensorStatsMonitor
from mindmon.kernels.device import LEVELS
from mindmon.kernels.dispatches import count_kernel_launches
from mindmon.kernels.stats import SquaredNorms

OPS = ("min", "max", "mean", "norm", "zeros", "nans", "id")
EPS = 1e-8

# The kernels of one dtype group of a collection point, every op asked: one concatenation; the columns
# (squares; NaN flags as float; |x| < eps flags as float) stacked; the sums level by level; min; max.
POINT = Counter({"Concat": 1, "Square": 1, "IsNan": 1, "Cast": 2, "Abs": 1, "Less": 1, "Stack": 1,
                 "UnsortedSegmentSum": LEVELS, "UnsortedSegmentMin": 1, "UnsortedSegmentMax": 1})
# Squared norms of one dtype group: a concatenation, the squares, the sums level by level.
NORMS = Counter({"Concat": 1, "Square": 1, "UnsortedSegmentSum": LEVELS})
# grad_unreduced's sums, per micro-batch of float32 gradients and one float16 one: the float32 ones
# concatenated, the float16 one cast, the two groups concatenated; from the second on, one add into the
# step's flat sum. Their statistics: a point's kernels on the flat sum, which needs no concatenation.
FIRST_MICRO_BATCH = Counter({"Concat": 2, "Cast": 1})
LATER_MICRO_BATCH = FIRST_MICRO_BATCH + Counter({"AddExt": 1})
SUMS_STATISTICS = POINT - Counter({"Concat": 1})


def _dense_stack(layers: int, width: int = 6) -> nn.Cell:
    """`layers` Dense cells: 2 x `layers` parameter tensors, of a few different shapes."""
    widths = [width] + [width + (i % 3) for i in range(layers)]
    return nn.SequentialCell([nn.Dense(widths[i], widths[i + 1], weight_init="normal") for i in range(layers)])


def _numpy_row(values: np.ndarray, scalar: bool) -> list:
    """The statistics of one tensor by numpy in float64, from its definition (tensor_stats/monitor.py)."""
    flat = values.astype(np.float64).reshape(-1)
    if not flat.size:
        return [math.nan, math.nan, math.nan, 0.0, math.nan, 0.0, math.nan]
    nans = int(np.isnan(flat).sum())
    return [math.nan if nans else flat.min(), math.nan if nans else flat.max(), flat.mean(),
            math.sqrt(np.dot(flat, flat)), float(np.mean(np.abs(flat) < EPS)), float(nans),
            float(flat[0]) if scalar else math.nan]


def _assert_rows(got: np.ndarray, tensors) -> None:
    for row, tensor in zip(got, tensors):
        values = tensor.astype(ms.float32).asnumpy()
        want = _numpy_row(values, not tensor.shape)
        scale = float(np.nanmean(np.abs(values))) if values.size and not np.isnan(values).all() else 1.0
        for op, value, expected in zip(OPS, row, want):
            if math.isnan(expected):
                assert math.isnan(value), (op, value, tensor.shape)
            else:   # float32 precision: of the value, or of the data's magnitude for a mean near zero
                assert value == pytest.approx(expected, rel=2e-6, abs=2e-6 * scale), (op, value, expected)


def _point_launches(tensors) -> tuple:
    monitor = TensorStatsMonitor(OPS, EPS, on_host=False)
    named = [(f"t{i}", t) for i, t in enumerate(tensors)]
    monitor.record("param_origin", named)   # warm: MindSpore's first call of a kernel
    monitor.reset()
    with count_kernel_launches() as recorded:
        monitor.record("param_origin", named)
    with count_kernel_launches() as read:
        records = monitor.collect(step=1)
    return recorded, read, np.array([r.value for r in records])


@pytest.mark.parametrize("layers", [4, 32], ids=["8_tensors", "64_tensors"])
def test_a_collection_point_takes_the_same_kernels_for_8_and_64_tensors(layers):
    parameters = list(_dense_stack(layers).get_parameters())
    assert len(parameters) == 2 * layers
    recorded, read, values = _point_launches(parameters)
    assert Counter(recorded.names) == POINT and recorded.count == 13
    assert read.names == ["Concat"]   # the step's one transfer: every part concatenated, then read
    _assert_rows(values, parameters)


def test_mixed_dtypes_take_one_group_each_and_give_numpys_numbers():
    rng = np.random.default_rng(5)
    data = [rng.normal(0.3, 2.0, (40, 30)), np.array([1.0, np.nan, -4.0, 0.0]), np.zeros((3, 5)),
            np.array(2.5), rng.normal(size=70000), np.zeros((0, 4)), np.array([np.inf, 1.0, -2.0]),
            np.full(3, -np.inf), np.array(np.inf)]
    tensors = [Tensor(a.astype(np.float32)) for a in data]
    tensors += [Tensor(rng.normal(size=(16, 8)).astype(np.float32)).astype(ms.float16),
                Tensor(np.array([0.0, 3.0, np.nan], np.float32)).astype(ms.float16),
                Tensor(rng.normal(size=(9, 7)).astype(np.float32)).astype(ms.bfloat16),
                Tensor(np.float32(-0.75)).astype(ms.bfloat16)]
    recorded, read, values = _point_launches(tensors)
    # float32, float16, bfloat16: each group its own kernels, the two narrow ones cast to float32 once
    assert Counter(recorded.names) == POINT + POINT + POINT + Counter({"Cast": 2})
    _assert_rows(values, tensors)
    assert values[3].tolist() == [2.5, 2.5, 2.5, 2.5, 0.0, 0.0, 2.5]       # a 0-dim tensor: id is its value
    assert values[2][:6].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]   # all zeros
    assert np.isnan(values[1][:3]).all() and values[1][4:6].tolist() == [0.25, 1.0]
    assert values[6][1] == np.inf and values[6][3] == np.inf
    assert values[7][:2].tolist() == [-np.inf, -np.inf] and values[8][:2].tolist() == [np.inf, np.inf]


@pytest.mark.parametrize("layers", [4, 32], ids=["8_tensors", "64_tensors"])
def test_squared_norms_take_the_same_kernels_for_8_and_64_tensors(layers):
    parameters = list(_dense_stack(layers).get_parameters())
    norms = SquaredNorms(on_host=False)
    norms.add("warm", parameters)
    norms.results()
    norms.clear()
    with count_kernel_launches() as added:
        norms.add("g", parameters)
    assert Counter(added.names) == NORMS
    expected = [float(np.sum(p.asnumpy().astype(np.float64) ** 2)) for p in parameters]
    np.testing.assert_allclose(norms.results()["g"], expected, rtol=2e-6)


def _step_launches(layers: int, monitored: bool, tmp_path, micro_steps: int) -> tuple:
    """Kernels of one training step on the device path (the accumulation as MindSpore ops), with or
    without train_state's norms; and the norms' records."""
    ms.set_seed(1)
    model = _dense_stack(layers)
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-3)
    names = [p.name for p in optimizer.parameters]
    group = None
    if monitored:
        config = parse_sections({"monitor": {"output_dir": str(tmp_path), "train_state": {
            "local_norm": True, "device_norm": True}}})
        group = build_group(config, model=model, parameter_names=names, on_host=False)
        group.setup()

    def loss_fn(x, y):
        return ((model(x) - y) ** 2).mean()

    step = AccumulatingTrainStep(loss_fn, optimizer, micro_steps, group=group, on_host=False)
    rng = np.random.default_rng(2)
    width = 6 + ((layers - 1) % 3)
    batch = (Tensor(rng.normal(size=(6, 6)).astype(np.float32)),
             Tensor(rng.normal(size=(6, width)).astype(np.float32)))
    for index in (1, 2):
        with count_kernel_launches() as launched:
            step(split_batch(batch, micro_steps))
            if group is not None:
                group.flush(index)
    if group is not None:
        group.close()
    return launched, len(names)


@pytest.mark.parametrize("layers", [4, 32], ids=["8_tensors", "64_tensors"])
def test_train_state_norms_take_the_same_kernels_per_micro_step(layers, tmp_path):
    micro_steps = 3
    off, tensors = _step_launches(layers, False, tmp_path / "off", micro_steps)
    on, _ = _step_launches(layers, True, tmp_path / "on", micro_steps)
    assert tensors == 2 * layers
    # Micro-step 0: the accumulated gradient's norms (the micro-batch's are the same); every later one:
    # the accumulated and the micro-batch gradient's; at flush the one transfer of the step.
    added = Counter(on.names) - Counter(off.names)
    assert added == NORMS + NORMS + NORMS + NORMS + NORMS + Counter({"Concat": 1})
    assert sum(added.values()) == on.count - off.count == 5 * sum(NORMS.values()) + 1


def _micro_gradients(shapes, micro_batches: int, seed: int) -> list:
    """A step's micro-batch gradients: float32, parameter 1's float16, a NaN in parameter 2's second."""
    rng = np.random.default_rng(seed)
    micro = [[Tensor(rng.normal(0.1 * k, 1.0 + k, size=shape).astype(np.float32)) for shape in shapes]
             for k in range(micro_batches)]
    for grads in micro:
        grads[1] = grads[1].astype(ms.float16)
    with_nan = micro[1][2].asnumpy().copy()
    with_nan.reshape(-1)[3] = np.nan
    micro[1][2] = Tensor(with_nan)
    return micro


def _summed_step(sums: GradientSums, monitor: TensorStatsMonitor, micro) -> tuple:
    """One step of hooks (each micro-batch's gradients in a backward pass's order, last parameter first)
    and its grad_unreduced record: the kernels of each micro-batch, of the statistics, of the read."""
    per_micro_batch = []
    for grads in micro:
        with count_kernel_launches() as launched:
            for index in reversed(range(len(grads))):
                sums.add(index, f"p{index}", grads[index])
        per_micro_batch.append(Counter(launched.names))
    with count_kernel_launches() as statistics:
        monitor.record("grad_unreduced", sums.for_recording(monitor.stats))
    with count_kernel_launches() as read:
        records = monitor.collect(step=1)
    sums.clear()
    return per_micro_batch, Counter(statistics.names), read.names, records


@pytest.mark.parametrize("layers", [4, 32], ids=["8_tensors", "64_tensors"])
def test_gradient_sums_take_the_same_kernels_per_micro_batch_for_8_and_64_tensors(layers):
    shapes = [tuple(p.shape) for p in _dense_stack(layers).get_parameters()]
    micro_batches = 3
    sums = GradientSums(on_host=False, per_micro_batch=False, on_micro_gradient=None)
    monitor = TensorStatsMonitor(OPS, EPS, on_host=False)
    sums.expect(len(shapes), micro_batches, monitor.stats)
    _summed_step(sums, monitor, _micro_gradients(shapes, micro_batches, seed=1))   # warm
    micro = _micro_gradients(shapes, micro_batches, seed=2)
    per_micro_batch, statistics, read, records = _summed_step(sums, monitor, micro)
    assert per_micro_batch == [FIRST_MICRO_BATCH, LATER_MICRO_BATCH, LATER_MICRO_BATCH]
    assert sum(LATER_MICRO_BATCH.values()) == 4
    assert statistics == SUMS_STATISTICS and sum(statistics.values()) == 12
    assert read == ["Concat"]
    assert [r.name for r in records] == [f"p{i}" for i in range(len(shapes))]
    assert [r.shape for r in records] == shapes
    assert [r.dtype for r in records] == ["Float32", "Float16"] + ["Float32"] * (len(shapes) - 2)
    expected = [sum(grads[i].astype(ms.float32).asnumpy().astype(np.float64) for grads in micro)
                for i in range(len(shapes))]
    _assert_rows(np.array([r.value for r in records]), [Tensor(e.astype(np.float32)) for e in expected])
    assert np.isnan(records[2].value[:4]).all() and records[2].value[5] == 1.0   # the NaN: min, max, mean, norm


def test_gradient_sums_of_irregular_micro_batches_equal_numpys():
    """A parameter without a gradient in one micro-batch, one that first comes in the second, one whose
    dtype changes: the flat sum is laid out again (a gather), and every sum is still numpy's."""
    rng = np.random.default_rng(3)
    shapes = [(5, 4), (7,), (3, 3), ()]
    micro = [{index: Tensor(rng.normal(size=shape).astype(np.float32)) for index, shape in enumerate(shapes)}
             for _ in range(3)]
    del micro[0][3], micro[1][0]                               # 3 comes late; 0 misses micro-batch 1
    micro[2][1] = micro[2][1].astype(ms.float16)               # 1's dtype changes
    sums = GradientSums(on_host=False, per_micro_batch=False, on_micro_gradient=None)
    monitor = TensorStatsMonitor(OPS, EPS, on_host=False)
    sums.expect(len(shapes), 3, monitor.stats)
    for grads in micro:
        for index, grad in grads.items():
            sums.add(index, f"p{index}", grad)
    found = dict(sums.named_sums())
    monitor.record("grad_unreduced", sums.for_recording(monitor.stats))
    records = {r.name: r for r in monitor.collect(step=1)}
    for index, shape in enumerate(shapes):
        expected = sum(grads[index].astype(ms.float32).asnumpy().astype(np.float64) for grads in micro
                       if index in grads)
        np.testing.assert_allclose(found[f"p{index}"].asnumpy(), expected, rtol=1e-6, atol=1e-6)
        assert found[f"p{index}"].shape == shape
        _assert_rows(np.array([records[f"p{index}"].value]), [Tensor(np.float32(expected))])
    assert records["p3"].value[6] == pytest.approx(float(micro[1][3].asnumpy() + micro[2][3].asnumpy()))
    assert records["p1"].dtype == "Float32" and records["p3"].shape == ()   # as the first gradient gave them
    with pytest.raises(ValueError, match=r"a gradient of 4 elements, \(4,\), for a sum of 9"):
        sums.add(2, "p2", Tensor(np.ones(4, np.float32)))
        sums.flush()
