"""`numpy_stats`, the host statistics of one array, op by op: every op alone and in pairs, on the
float64 path (up to 4096 elements) and the blocked float32 path (more), against float64 numpy; an
empty array; values exactly at `eps`; the exact float64 sum of small arrays; `id`."""
import math

import numpy as np
import pytest

from mindmon.features.tensor_stats.monitor import numpy_stats
from mindmon.features.tensor_stats.points import OPS

pytestmark = pytest.mark.ms27

EPS = 0.5   # exactly representable, so values equal to it can be planted


def expected(values: np.ndarray, op: str, scalar: bool = False) -> float:
    flat = values.astype(np.float64).reshape(-1)
    if op == "id":
        return float(flat[0]) if scalar else math.nan
    if op == "nans":
        return float(np.count_nonzero(np.isnan(flat)))
    if op == "norm":
        return math.sqrt(float(np.dot(flat, flat)))
    if not flat.size:
        return math.nan
    return {"min": flat.min(), "max": flat.max(), "mean": flat.mean(),
            "zeros": np.count_nonzero(np.abs(flat) < EPS) / flat.size}[op]


def assert_same(got, want, label):
    if math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), (label, got)
    else:
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), (label, got, want)


def sample(size: int, with_nan: bool) -> np.ndarray:
    rng = np.random.default_rng(size + with_nan)
    data = rng.normal(0.2, 1.0, size).astype(np.float32)
    data[::7] = EPS                     # exactly at eps: not below it
    data[1::7] = -EPS
    data[2::7] = np.float32(0.25)       # below it
    if with_nan:
        data[size // 2] = np.nan
    return data


SINGLES = [(op,) for op in OPS]
PAIRS = [("nans", "min"), ("mean", "zeros"), ("zeros", "nans"), ("norm", "max")]


@pytest.mark.parametrize("size", [100, 4096, 4097, 70000])
@pytest.mark.parametrize("with_nan", [False, True], ids=["finite", "nan"])
@pytest.mark.parametrize("ops", SINGLES + PAIRS, ids="+".join)
def test_each_op_alone_and_in_pairs(size, with_nan, ops):
    data = sample(size, with_nan)
    got = numpy_stats(data, ops, EPS)
    assert len(got) == len(ops)
    for op, value in zip(ops, got):
        assert_same(value, expected(data, op), (size, op))


@pytest.mark.parametrize("ops", SINGLES + [OPS], ids="+".join)
def test_an_empty_array(ops):
    """No elements: min, max, mean, zeros and id are NaN, nans is 0 and the norm 0."""
    got = numpy_stats(np.empty(0, np.float32), ops, EPS)
    for op, value in zip(ops, got):
        assert_same(value, {"nans": 0.0, "norm": 0.0}.get(op, math.nan), op)


def test_small_arrays_are_summed_exactly_in_float64():
    """Up to 4096 elements the sum is float64: 2**24 and 4095 ones give their exact mean (float32
    partial sums would drop ones added to 2**24)."""
    data = np.ones(4096, np.float32)
    data[0] = 2 ** 24
    assert numpy_stats(data, ("mean",), EPS)[0] == (2 ** 24 + 4095) / 4096


@pytest.mark.parametrize("size", [16, 70000])
def test_id_is_nan_unless_the_tensor_is_a_scalar(size):
    data = np.full(size, 3.5, np.float32)
    assert math.isnan(numpy_stats(data, ("id",), EPS)[0])
    assert numpy_stats(data[:1], ("id", "max"), EPS, scalar=True) == [3.5, 3.5]


@pytest.mark.parametrize("with_nan", [False, True], ids=["finite", "nan"])
@pytest.mark.parametrize("ops", SINGLES + PAIRS, ids="+".join)
def test_device_path_op_by_op(with_nan, ops):
    """The device path (statistics reduced by MindSpore, read later) gives the same numbers, each op alone."""
    import mindspore as ms

    from mindmon.kernels.device import single_statistics

    data = sample(100, with_nan)
    got = single_statistics(ms.Tensor(data), ops, EPS)
    for op, value in zip(ops, got):
        want = expected(data, op)
        if math.isnan(want):
            assert math.isnan(value), (op, value)
        else:
            assert value == pytest.approx(want, rel=1e-5, abs=1e-6), (op, value, want)


def test_device_path_of_a_scalar():
    """A 0-dim tensor: one element, so `zeros` is 0 or 1, and `id` is its value."""
    import mindspore as ms

    from mindmon.kernels.device import single_statistics

    got = single_statistics(ms.Tensor(np.float32(0.25)), ("zeros", "id", "mean"), EPS)
    assert got == [1.0, 0.25, 0.25]


def test_no_direct_view_where_it_is_not_allowed(monkeypatch):
    """Asynchronous execution (or MindSpore before 2.8): tensors are read through asnumpy(), never a
    pointer view, whatever else TensorStats knows about them."""
    import mindspore as ms

    from mindmon.kernels import stats
    from mindmon.features.tensor_stats.monitor import TensorStats

    monkeypatch.setattr(stats, "direct_views_allowed", lambda: False)
    views = []
    original = stats.direct_view
    monkeypatch.setattr(stats, "direct_view", lambda *args: views.append(args) or original(*args))
    collected = TensorStats(("max", "min"), EPS, on_host=True)
    collected.add("actv", [("x", ms.Tensor(np.arange(3, dtype=np.float32)) * 2)])
    assert views == [] and collected.results()[0][4].tolist() == [[4.0, 0.0]]


def test_monitor_keeps_its_rank_and_the_path_asked_for():
    """The rank given (default 0) is every record's; on CPU the host path is the default, and a
    monitor asked for the device path keeps it (same numbers, read once at collect)."""
    import mindspore as ms

    from mindmon.features.tensor_stats.monitor import TensorStatsMonitor

    assert TensorStatsMonitor(("max",)).stats.on_host is True
    assert TensorStatsMonitor(("max",), on_host=False).stats.on_host is False
    for rank, monitor in ((0, TensorStatsMonitor(("max",))), (3, TensorStatsMonitor(("max",), rank=3))):
        monitor.record("param_origin", [("w", ms.Tensor(np.ones(2, np.float32)))])
        (record,) = monitor.collect(1)
        assert (record.rank, record.value) == (rank, [1.0])


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
def test_rows_keep_the_ops_they_were_taken_with(on_host):
    """ops changed in the middle of a step (msprobe allows it): rows gathered before keep their own ops and
    values, the later ones get the new ops; on the device path both reach the host in one transfer."""
    import mindspore as ms

    from mindmon.features.tensor_stats.monitor import TensorStatsMonitor

    monitor = TensorStatsMonitor(("min", "max", "norm"), on_host=on_host)
    data = np.array([3.0, -4.0], np.float32)
    monitor.record("actv", [("a", ms.Tensor(data)), ("b", ms.Tensor(-data))])
    monitor.ops = ("norm", "min")
    monitor.record("actv", [("c", ms.Tensor(data * 2))])
    got = [(r.name, r.ops, r.value) for r in monitor.collect(step=1)]
    assert got == [("a", ("min", "max", "norm"), [-4.0, 3.0, 5.0]), ("b", ("min", "max", "norm"), [-3.0, 4.0, 5.0]),
                   ("c", ("norm", "min"), [10.0, -8.0])]


def test_device_rows_reach_the_host_as_float64_arrays():
    """On the device path too, `results()` hands back numpy float64 arrays [tensors, ops], each add's
    rows in its own array (values chosen exact in float32, so float64 numpy's are the same)."""
    import mindspore as ms

    from mindmon.features.tensor_stats.monitor import TensorStats

    stats = TensorStats(("max", "mean"), EPS, on_host=False)
    data = np.array([1.5, -2.0, 4.0, 0.5], np.float32)
    stats.add("actv", [("a", ms.Tensor(data)), ("b", ms.Tensor(-data))])
    stats.add("actv_grad", [("c", ms.Tensor(data[:2]))])
    got = [entry.values for entry in stats.results()]
    assert all(isinstance(values, np.ndarray) and values.dtype == np.float64 for values in got)
    wide = data.astype(np.float64)
    want = [[[wide.max(), wide.mean()], [(-wide).max(), (-wide).mean()]], [[wide[:2].max(), wide[:2].mean()]]]
    assert [values.tolist() for values in got] == want


def test_held_tensors_keep_their_order_among_rows_taken_at_once_and_are_let_go():
    """`add_later` holds tensors (float32, float16 and a strided slice among them) until `results()`; an
    `add` to the same batch in between takes the held ones first, so each batch's rows stay in the order
    they were added; after `results()` nothing is held."""
    import gc
    import weakref

    import mindspore as ms

    from mindmon.features.tensor_stats.monitor import TensorStats

    ops = ("min", "max", "mean")
    wide = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    arrays = {"a": np.array([1.0, -2.0], np.float32), "b": np.array([0.5, 8.0, -1.0], np.float16),
              "c": wide[:, 1:3], "d": np.array([3.0, -6.0], np.float32)}
    tensors = {"a": ms.Tensor(arrays["a"]), "b": ms.Tensor(arrays["b"]), "c": ms.Tensor(wide)[:, 1:3],
               "d": ms.Tensor(arrays["a"]) * 3}
    stats = TensorStats(ops, EPS, on_host=True)
    stats.add_later("actv", [("a", tensors["a"]), ("b", tensors["b"])], 0)
    stats.add("actv", [("c", tensors["c"])], 0)
    stats.add_later("actv", [("d", tensors["d"])], 0)
    stats.add_later("actv_grad", [("c", tensors["c"])], 1)
    held = weakref.ref(tensors.pop("d"))
    gc.collect()
    assert held() is not None
    got = [(entry.point, entry.micro_step, entry.names, entry.values.tolist()) for entry in stats.results()]

    def row(name):
        flat = arrays[name].astype(np.float64).reshape(-1)
        return [flat.min(), flat.max(), flat.mean()]
    assert got == [("actv", 0, ["a", "b", "c", "d"], [row(n) for n in "abcd"]), ("actv_grad", 1, ["c"], [row("c")])]
    gc.collect()
    assert held() is None


def test_a_tensor_given_more_than_once_is_read_once(monkeypatch):
    """One tensor at several places of one call (a cell's output that is the next cells' input), adjacent
    or not: the compiled read gets it once, and each of its rows holds its own statistics (numpy's)."""
    import mindspore as ms

    from mindmon.features.tensor_stats import monitor

    read = []
    original = monitor.reductions_at
    monkeypatch.setattr(monitor, "reductions_at", lambda table, *args: read.append(table.size // 4) or
                        original(table, *args))
    arrays = [np.array([1.0, -2.0, 4.0], np.float32), np.array([0.5, 3.0], np.float32)]
    a, b = ms.Tensor(arrays[0]) * 1, ms.Tensor(arrays[1]) * 1
    ops = ("min", "max", "mean", "norm")
    rows, layouts = monitor.host_statistics([a, b, a, a, b], ops, EPS, True)
    want = [[x.min(), x.max(), x.mean(), np.linalg.norm(x)] for x in (v.astype(np.float64) for v in arrays)]
    np.testing.assert_allclose(rows, [want[0], want[1], want[0], want[0], want[1]], rtol=1e-6)
    assert read == [2] and [tuple(shape) for shape, _ in layouts] == [(3,), (2,), (3,), (3,), (2,)]


def test_tensors_on_the_same_memory_are_read_once(monkeypatch):
    """Tensors that are views of one piece of memory (a reshape, a `HookBackward` marker's output, as a cell's
    input passed through its `input_grad` marker is) are read once; a view of part of it, and a 0-dim view of
    a one-element tensor (its `id` is its value, the 1-D tensor's NaN), are read apart."""
    import mindspore as ms
    from mindspore import ops as msops

    from mindmon.features.tensor_stats import monitor

    read = []
    original = monitor.reductions_at
    monkeypatch.setattr(monitor, "reductions_at", lambda table, *args: read.append(table.size // 4) or
                        original(table, *args))
    values = np.array([[1.0, -2.0, 4.0], [0.5, 3.0, -8.0]], np.float32)
    a, one = ms.Tensor(values) * 1, ms.Tensor(np.array([2.5], np.float32)) * 1
    marked = msops.HookBackward(lambda gradient: None)(a)
    tensors = [a, a.reshape(3, 2), marked, a[0], one, one.reshape(())]
    assert len({t._data_ptr() for t in tensors[:4]}) == 1 and one.reshape(())._data_ptr() == one._data_ptr()
    ops = ("min", "max", "norm", "id")
    rows, _ = monitor.host_statistics(tensors, ops, EPS, True)
    whole, first_row = values.astype(np.float64), values[0].astype(np.float64)
    want_whole = [whole.min(), whole.max(), np.linalg.norm(whole), math.nan]
    np.testing.assert_allclose(rows, [want_whole, want_whole, want_whole,
                                      [first_row.min(), first_row.max(), np.linalg.norm(first_row), math.nan],
                                      [2.5, 2.5, 2.5, math.nan], [2.5, 2.5, 2.5, 2.5]], rtol=1e-6)
    assert read == [4]   # a, a[0], one, one.reshape(())
