"""The statistics engine alone: NaN/Inf kept, bfloat16, both paths (numpy on CPU, device ops) against numpy."""
import math

import mindspore as ms
import numpy as np
import pytest

from mindmon.features.tensor_stats.monitor import TensorStatsMonitor
from mindmon.features.tensor_stats.points import OPS
from tests.support.msprobe_reference import statistic

pytestmark = pytest.mark.ms27   # also runs on MindSpore 2.7 (make test-ms27)


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy", "device"])
def test_nan_and_inf_are_recorded_not_dropped(on_host):
    data = np.array([[1.0, np.nan, -3.0], [0.0, 5e-9, np.inf]], np.float32)
    monitor = TensorStatsMonitor(OPS, eps=1e-8, on_host=on_host)
    monitor.record("grad_reduced", [("w", ms.Tensor(data))])
    (record,) = monitor.collect(1)
    stats = dict(zip(record.ops, record.value))
    assert all(math.isnan(stats[op]) for op in ("min", "max", "mean", "norm")), stats
    assert stats["nans"] == 1 and math.isclose(stats["zeros"], 2 / 6, rel_tol=1e-6)
    monitor.record("grad_reduced", [("w", ms.Tensor(np.array([1.0, -np.inf], np.float32)))])
    (record,) = monitor.collect(2)
    assert record.value[:4] == [-math.inf, 1.0, -math.inf, math.inf]


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy", "device"])
@pytest.mark.parametrize("dtype", [ms.float32, ms.bfloat16, ms.float16], ids=str)
def test_many_tensors_match_float64_numpy(on_host, dtype):
    rng = np.random.default_rng(7)
    arrays = [rng.normal(0, 1, (64, 96)).astype(np.float32), rng.normal(3, 0.01, (5000,)).astype(np.float32),
              np.where(rng.random((7, 3)) < 0.5, 0, 1e-3).astype(np.float32)]
    tensors = [ms.Tensor(a).astype(dtype) for a in arrays]
    ops = ("nans", "norm", "mean", "zeros", "max", "min")   # any order: values follow it
    monitor = TensorStatsMonitor(ops, eps=1e-6, on_host=on_host)
    monitor.record("param_origin", [(f"t{i}", t) for i, t in enumerate(tensors)])
    records = monitor.collect(1)
    assert [r.name for r in records] == ["t0", "t1", "t2"] and records[0].shape == (64, 96)
    assert records[0].dtype == str(dtype)
    for record, tensor in zip(records, tensors):
        values = tensor.astype(ms.float32).asnumpy()   # what the low-precision tensor holds, exactly
        for op, value in zip(record.ops, record.value):
            expected = statistic(values, op, 1e-6)
            scale = np.abs(values).max() if op == "mean" else abs(expected)
            assert abs(value - expected) <= 2e-6 * scale + 1e-12, (op, value, expected)


def test_ops_change_takes_effect_for_later_records():
    monitor = TensorStatsMonitor(("min",), on_host=True)
    monitor.ops = ["max", "nans"]
    monitor.record("exp_avg", [("w", ms.Tensor(np.array([1.0, 2.0], np.float32)))], {"micro_step": 1})
    (record,) = monitor.collect(4)
    assert (record.ops, record.value, record.micro_step, record.step) == (("max", "nans"), [2.0, 0.0], 1, 4)


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy", "device"])
def test_id_is_the_value_of_a_scalar(on_host):
    monitor = TensorStatsMonitor(("id", "max"), on_host=on_host)
    monitor.record("param_origin", [("scale", ms.Tensor(np.float32(2.5))), ("w", ms.Tensor(np.ones(3, np.float32)))])
    scalar, vector = monitor.collect(1)
    assert scalar.value == [2.5, 2.5] and scalar.shape == ()
    assert math.isnan(vector.value[0]) and vector.value[1] == 1.0
    # non-finite 0-dim values (taken with numpy's NaN rules, not by the one-pass loop)
    monitor.record("param_origin", [("inf", ms.Tensor(np.float32(-np.inf))), ("nan", ms.Tensor(np.float32(np.nan)))])
    infinite, missing = monitor.collect(2)
    assert infinite.value == [-math.inf, -math.inf] and all(math.isnan(v) for v in missing.value)
    # tensors that are not float32 (taken through numpy): a 0-dim one's id is its value, a vector's is NaN
    monitor.record("param_origin", [("step", ms.Tensor(np.int32(7))), ("ids", ms.Tensor(np.array([3, 5], np.int32)))])
    count, ids = monitor.collect(3)
    assert count.value == [7.0, 7.0] and math.isnan(ids.value[0]) and ids.value[1] == 5.0


def test_points_gathered_on_the_device_are_each_their_own_statistics():
    """Off the host, each point's statistics are device tensors until one transfer at collect, then split
    back per point: three points, each checked against numpy."""
    arrays = {"param_origin": np.array([1.0, -2.0, 4.0], np.float32), "grad_reduced": np.array([0.5], np.float32),
              "exp_avg": np.array([[3.0, -1.0], [2.0, 8.0]], np.float32)}
    monitor = TensorStatsMonitor(("max", "mean"), on_host=False)
    for point, array in arrays.items():
        monitor.record(point, [(point, ms.Tensor(array))])
    records = monitor.collect(1)
    assert [(r.kind, r.value) for r in records] == [
        (point, [float(array.max()), float(array.mean())]) for point, array in arrays.items()]


def test_huge_float32_values_do_not_overflow(recwarn):
    data = np.full(70000, 3e38, np.float32)   # any float32 partial sum of two of them overflows
    monitor = TensorStatsMonitor(("mean", "nans", "norm"), on_host=True)
    monitor.record("param_origin", [("w", ms.Tensor(data))])
    (record,) = monitor.collect(1)
    value = float(np.float32(3e38))
    assert math.isclose(record.value[0], value, rel_tol=1e-7) and record.value[1] == 0.0
    assert math.isclose(record.value[2], value * math.sqrt(70000), rel_tol=1e-7)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_infinities_of_both_signs_give_a_nan_mean_and_no_warning(recwarn):
    """inf + -inf is NaN (the float64 re-sum after a non-finite block sum), said by no RuntimeWarning."""
    data = np.random.default_rng(19).normal(size=70000).astype(np.float32)
    data[5], data[66000] = np.inf, -np.inf
    monitor = TensorStatsMonitor(("min", "max", "mean", "norm", "nans", "zeros"), on_host=True)
    monitor.record("grad_reduced", [("w", ms.Tensor(data))])
    (record,) = monitor.collect(1)
    assert record.value[:2] == [-math.inf, math.inf] and math.isnan(record.value[2])
    assert record.value[3:5] == [math.inf, 0.0]
    assert record.value[5] == np.count_nonzero(np.abs(data.astype(np.float64)) < 1e-8) / data.size
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


BOUNDARY_SIZES = (4095, 4096, 4097, 65535, 65536, 65537, 3_000_017)


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy", "device"])
@pytest.mark.parametrize("dtype", [ms.float32, ms.bfloat16, ms.float16], ids=str)
def test_every_block_boundary_and_a_few_million(on_host, dtype):
    """Large float32 tensors are read block by block (65536 elements); sizes on both sides of each
    boundary and a few million, a tenth of them exact zeros, against float64 numpy."""
    rng = np.random.default_rng(13)
    arrays = [np.where(rng.random(n) < 0.1, 0.0, rng.normal(0.3, 1.0, n)).astype(np.float32) for n in BOUNDARY_SIZES]
    tensors = [ms.Tensor(a).astype(dtype) for a in arrays]
    ops = ("min", "max", "mean", "norm", "zeros", "nans")
    monitor = TensorStatsMonitor(ops, eps=1e-6, on_host=on_host)
    monitor.record("grad_reduced", [(f"t{i}", t) for i, t in enumerate(tensors)])
    for record, tensor in zip(monitor.collect(1), tensors):
        values = tensor.astype(ms.float32).asnumpy()
        for op, value in zip(record.ops, record.value):
            expected = statistic(values, op, 1e-6)
            scale = np.abs(values).max() if op == "mean" else abs(expected)
            assert abs(value - expected) <= 1e-5 * scale + 1e-12, (record.name, op, value, expected)


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy", "device"])
@pytest.mark.parametrize("where", [0, 65536, 3_000_016], ids=["first-block", "block-start", "last-element"])
def test_nan_and_inf_in_any_block_of_a_large_tensor(on_host, where):
    data = np.random.default_rng(17).normal(0.0, 1.0, 3_000_017).astype(np.float32)
    with_nan, with_inf = data.copy(), data.copy()
    with_nan[where], with_nan[where // 2 + 1] = np.nan, np.nan
    with_inf[where] = -np.inf
    monitor = TensorStatsMonitor(("min", "max", "mean", "norm", "nans"), on_host=on_host)
    monitor.record("grad_reduced", [("nan", ms.Tensor(with_nan)), ("inf", ms.Tensor(with_inf))])
    nan_record, inf_record = monitor.collect(1)
    assert all(math.isnan(v) for v in nan_record.value[:4]) and nan_record.value[4] == 2.0
    assert inf_record.value[0] == -math.inf and inf_record.value[1] == pytest.approx(float(data.max()))
    assert inf_record.value[2] == -math.inf and inf_record.value[3] == math.inf and inf_record.value[4] == 0.0
