"""The numpy view built from a CPU tensor's data pointer (mindmon/kernels/stats.py): the same elements as
asnumpy() for every dtype and layout it accepts, None for those it leaves to asnumpy()."""
import math

import numpy as np
import mindspore as ms
from mindspore import mint

from mindmon.features.tensor_stats.monitor import TensorStats
from mindmon.kernels.stats import direct_view, host_array, direct_views_allowed


def test_views_equal_asnumpy_and_views_are_taken_where_safe():
    base = ms.Tensor(np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 7.5)
    cases = {
        "contiguous": (base, True),
        "offset rows (narrow on dim 0, contiguous)": (mint.narrow(base, 0, 1, 1), True),
        "strided columns (narrow on the last dim)": (mint.narrow(base, 2, 1, 2), True),
        "a split's middle part (rows of 4 of 12, offset 4)": (mint.split(base.reshape(2, 12), 4, dim=-1)[1], True),
        "transposed": (mint.transpose(base, 0, 2), True),
        "int32": (ms.Tensor(np.array([3, -1, 4], np.int32)), True),
        "float16": (ms.Tensor(np.array([0.5, -2.0], np.float16)), True),
        "bool": (ms.Tensor(np.array([True, False, True])), True),
        "0-dim": (ms.Tensor(np.float32(2.5)), True),
        "empty": (ms.Tensor(np.zeros((0, 3), np.float32)), True),
    }
    # the last three are strided views of `base`'s memory (what makes them a case), read through copies
    assert [label for label, (tensor, _) in cases.items() if not tensor.is_contiguous()] == list(cases)[2:5]
    for label, (tensor, direct) in cases.items():
        view = direct_view(tensor, str(tensor.dtype))
        assert (view is not None) == direct, label
        expected = tensor.asnumpy().reshape(-1)
        got = host_array(tensor, direct=True)
        assert got.dtype == expected.dtype and np.array_equal(got, expected), (label, got, expected)
    # The offset view starts at row 1, not at the storage's first element.
    assert host_array(mint.narrow(base, 0, 1, 1), direct=True)[0] == 12 - 7.5


def test_tensor_statistics_read_through_views_when_execution_is_synchronous():
    # The test session runs with pynative_synchronize=True (conftest).
    assert direct_views_allowed()
    tensor = ms.Tensor(np.linspace(-1, 1, 70001, dtype=np.float32))
    stats = TensorStats(("min", "max", "mean", "norm", "zeros"), 1e-8, on_host=True)
    stats.add("actv", [("x", tensor)])
    assert stats.direct_views.allowed() is True
    values = stats.results()[0][4][0]
    flat = tensor.asnumpy().astype(np.float64)
    want = [flat.min(), flat.max(), flat.mean(), np.sqrt((flat * flat).sum()),
            np.count_nonzero(np.abs(tensor.asnumpy()) < np.float32(1e-8)) / flat.size]
    # float32 accumulation: the mean within ~1e-7 of max|x| (= 1 here), the rest to relative 1e-6
    assert np.allclose(values, want, rtol=1e-6, atol=1e-7), (values, want)
    assert want[4] > 0   # linspace through 0 holds an exact zero: a zero count that could be wrong


def test_direct_only_when_asked_and_where_a_view_can_be_built():
    tensor = ms.Tensor(np.arange(6, dtype=np.float32))
    assert host_array(tensor, direct=True).base.owner is tensor   # the data pointer's view, holding its tensor
    assert getattr(host_array(tensor).base, "owner", None) is None   # default: asnumpy() waits
    # A numpy array (the host buffer's views) is flattened as it is, whatever its shape.
    matrix = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert host_array(matrix).shape == (12,) and np.shares_memory(host_array(matrix), matrix)


def test_direct_views_need_mindspore_2_8_and_synchronous_execution(monkeypatch):
    for version, allowed in (("2.7.1", False), ("2.8.0", True), ("2.10.0rc1", True), ("3.0", True)):
        monkeypatch.setattr(ms, "__version__", version)
        assert direct_views_allowed() is allowed, version
    monkeypatch.undo()
    ms.set_context(pynative_synchronize=False)
    try:
        assert direct_views_allowed() is False
    finally:
        ms.set_context(pynative_synchronize=True)   # as the test session's conftest sets it
    assert direct_views_allowed() is True


def test_a_view_keeps_its_tensor_alive_and_bfloat16_is_copied():
    import gc
    import weakref

    tensor = ms.Tensor(np.arange(3, dtype=np.float32))
    alive = weakref.ref(tensor)
    view = host_array(tensor, direct=True)
    del tensor
    gc.collect()
    assert alive() is not None and view.tolist() == [0.0, 1.0, 2.0]   # not freed under the view
    # numpy has no bfloat16: no view, a float64 copy of the exact values
    bf16 = ms.Tensor(np.array([1.5, -2.25, 3.0e38], np.float32)).astype(ms.bfloat16)
    assert direct_view(bf16, str(bf16.dtype)) is None
    copy = host_array(bf16, direct=True)
    assert copy.dtype == np.float64 and copy.tolist() == bf16.astype(ms.float32).asnumpy().astype(np.float64).tolist()


def _numpy_reference(array: np.ndarray) -> list:
    flat = array.reshape(-1).astype(np.float64)
    with np.errstate(invalid="ignore"):
        nans = np.isnan(flat)
        if nans.any():
            low = high = float("nan")
        else:
            low, high = flat.min(), flat.max()
        return [low, high, flat.sum() / flat.size, np.sqrt(np.dot(flat, flat)),
                np.count_nonzero(np.abs(array.reshape(-1)) < array.dtype.type(1e-8) if array.dtype.kind == "f"
                                 else np.abs(flat) < 1e-8) / flat.size,
                float(np.count_nonzero(nans))]


def test_float_tensors_are_read_at_their_address_and_everything_else_as_before(monkeypatch):
    """Float32 tensors go to the compiled loop by data pointer, no numpy array built, unless the sum shows
    NaN or inf (then their view is read again, with numpy's NaN rules); other dtypes, strided views and
    0-dim tensors take `numpy_stats` as before. Every case against float64 numpy."""
    from mindmon.features.tensor_stats import monitor as tensor_stats

    arrays = []
    original = tensor_stats.direct_view
    monkeypatch.setattr(tensor_stats, "direct_view", lambda *args: arrays.append(args[1]) or original(*args))
    rng = np.random.default_rng(7)
    base = ms.Tensor(rng.standard_normal((6, 5000)).astype(np.float32))
    with_nan = rng.standard_normal(3000)
    with_nan[17] = np.nan
    float32_nan = rng.standard_normal(9000).astype(np.float32)
    float32_nan[8999] = np.nan
    with_inf = rng.standard_normal(50).astype(np.float32)
    with_inf[3] = np.inf
    cases = {
        "float32": (base, False),
        "float64": (ms.Tensor(rng.standard_normal(777)), False),
        "rows 2-3 of a matrix (offset pointer)": (mint.narrow(base, 0, 2, 2), False),
        "strided columns": (mint.narrow(base, 1, 10, 20), False),
        "float64 with a NaN": (ms.Tensor(with_nan), False),
        "float32 with a NaN": (ms.Tensor(float32_nan), True),
        "float32 with inf": (ms.Tensor(with_inf), True),
        "float32 whose squares overflow float32 sums": (ms.Tensor(np.tile(np.float32([3e19, -3e19]), 2500)), True),
        "0-dim": (ms.Tensor(np.float32(-2.5)), False),
        "float16": (ms.Tensor(rng.standard_normal(300).astype(np.float16)), False),
        "int32": (ms.Tensor(np.array([3, -1, 0, 4], np.int32)), False),
    }
    ops = ("min", "max", "mean", "norm", "zeros", "nans")
    for label, (tensor, reads_again) in cases.items():
        arrays.clear()
        stats = TensorStats(ops, 1e-8, on_host=True)
        stats.add("actv", [("x", tensor)])
        got = stats.results()[0][4][0].tolist()
        want = _numpy_reference(tensor.asnumpy())
        assert np.allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True), (label, got, want)
        assert bool(arrays) == reads_again, (label, arrays)
    # All at once (one add, as a hook's inputs and outputs come): each row is its own tensor's, whatever
    # dtype or path its neighbours take.
    stats = TensorStats(ops, 1e-8, on_host=True)
    stats.add("actv", [(label, tensor) for label, (tensor, _) in cases.items()])
    for label, got in zip(cases, stats.results()[0][4].tolist()):
        want = _numpy_reference(cases[label][0].asnumpy())
        assert np.allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True), (label, got, want)


def test_empty_float32_tensors_are_not_read_at_their_address():
    """MindSpore gives an empty tensor a data pointer too; nothing may be read there. Its row is the empty
    tensor's: no min, max, mean or share of zeros (NaN), norm 0, no NaN counted, next to a normal row."""
    normal = ms.Tensor(np.float32([3.0, -4.0]))
    empties = [ms.Tensor(np.zeros((0,), np.float32)), ms.Tensor(np.zeros((3, 0), np.float32))]
    assert all(t._data_ptr() for t in empties)
    stats = TensorStats(("min", "max", "mean", "norm", "zeros", "nans"), 1e-8, on_host=True)
    stats.add("actv", [("a", empties[0]), ("b", normal), ("c", empties[1])])
    rows = stats.results()[0][4].tolist()
    empty = [math.nan, math.nan, math.nan, 0.0, math.nan, 0.0]
    assert np.array_equal(rows[0], empty, equal_nan=True) and np.array_equal(rows[2], empty, equal_nan=True)
    assert rows[1] == [-4.0, 3.0, -0.5, 5.0, 0.0, 0.0]


def test_ops_not_seen_before_get_their_codes(monkeypatch):
    """The ops -> codes table starts empty in a fresh process: ops in an order not used before get their
    codes (positions in `ROW_STATISTICS`) made, kept and read back, and the rows written with them are
    float64 numpy's."""
    from mindmon.features.tensor_stats import monitor as tensor_stats

    monkeypatch.setattr(tensor_stats, "_CODES", {})
    ops = ("norm", "nans", "min", "zeros")
    data = np.array([3.0, -4.0, 0.0, 12.0], np.float32)
    wide = data.astype(np.float64)
    want = [math.sqrt(float(np.dot(wide, wide))), 0.0, float(wide.min()), np.count_nonzero(np.abs(wide) < 1e-8) / 4]
    for _ in range(2):   # the codes made, then read from the table
        stats = TensorStats(ops, 1e-8, on_host=True)
        stats.add("actv", [("x", ms.Tensor(data))])
        assert stats.results()[0][4].tolist() == [want]
    assert tensor_stats._CODES[ops].tolist() == [3, 5, 0, 4]


def test_tensors_not_initialised_yet_are_read_through_asnumpy():
    """A tensor or Parameter made with an initializer has no memory until it is used (its data pointer is
    0): the direct read must not take it; asnumpy initialises it, and the statistics are of those values."""
    from mindspore.common.initializer import Constant

    lazy_tensor = ms.Tensor(shape=(3, 5), dtype=ms.float32, init=Constant(-2.5))
    lazy_parameter = ms.Parameter(ms.Tensor(shape=(4,), dtype=ms.float32, init=Constant(0.75)), name="p")
    assert lazy_tensor._data_ptr() == 0   # (a Parameter made from one is initialised when made, here)
    stats = TensorStats(("min", "max", "mean", "norm"), 1e-8, on_host=True)
    stats.add("actv", [("t", lazy_tensor), ("p", lazy_parameter)])
    values = stats.results()[0].values
    assert np.allclose(values[0], [-2.5, -2.5, -2.5, math.sqrt(15 * 2.5 ** 2)])
    assert np.allclose(values[1], [0.75, 0.75, 0.75, math.sqrt(4 * 0.75 ** 2)])


def test_strided_tensors_statistics_are_their_elements_statistics(monkeypatch):
    """The parts of a split (strided views of one tensor's memory: runs of the last dimension), a transposed
    view (no equal runs: copied first) and a part holding NaN (numpy's rules), through the statistics a hook
    takes, against float64 numpy of each part's own elements (asnumpy: an independent read)."""
    ops = ("min", "max", "mean", "norm", "zeros", "nans")
    base = ms.Tensor(np.random.default_rng(3).standard_normal((2, 64, 3 * 96)).astype(np.float32))
    holed = base.asnumpy().copy()
    holed[1, 5, 100] = np.nan
    parts = list(mint.split(base, 96, dim=-1)) + [mint.transpose(base, 1, 2),
                                                 mint.split(ms.Tensor(holed), 96, dim=-1)[1]]
    assert not any(part.is_contiguous() for part in parts)
    stats = TensorStats(ops, 1e-8, on_host=True)
    calls = []   # asnumpy() of a strided tensor makes a contiguous copy in MindSpore: none is asked for
    monkeypatch.setattr(ms.Tensor, "asnumpy", lambda self, real=ms.Tensor.asnumpy: calls.append(1) or real(self))
    stats.add("actv", [(f"part_{k}", part) for k, part in enumerate(parts)])
    assert calls == []
    monkeypatch.undo()
    (gathered,) = stats.results()
    for k, part in enumerate(parts):
        flat = part.asnumpy().reshape(-1).astype(np.float64)
        nan = bool(np.isnan(flat).any())
        want = [np.nan if nan else flat.min(), np.nan if nan else flat.max(), np.nan if nan else flat.mean(),
                np.nan if nan else np.sqrt(np.dot(flat, flat)), np.count_nonzero(np.abs(flat) < 1e-8) / flat.size,
                float(np.isnan(flat).sum())]
        assert np.allclose(gathered.values[k], want, rtol=1e-6, atol=1e-7, equal_nan=True), (k, gathered.values[k], want)
        assert gathered.layouts[k] == (tuple(part.shape), "Float32")
    assert gathered.values[4][5] == 1.0
