"""The numpy view built from a CPU tensor's data pointer (mindmon/stats.py): the same elements as
asnumpy() for every dtype and layout it accepts, None for those it leaves to asnumpy()."""
import numpy as np
import mindspore as ms
from mindspore import mint

from mindmon.monitors.tensor_stats import TensorStats
from mindmon.stats import _direct_view, _host_array, direct_views_allowed


def test_views_equal_asnumpy_and_views_are_taken_where_safe():
    base = ms.Tensor(np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 7.5)
    cases = {
        "contiguous": (base, True),
        "offset rows (narrow on dim 0, contiguous)": (mint.narrow(base, 0, 1, 1), True),
        "strided columns (narrow on the last dim)": (mint.narrow(base, 2, 1, 2), False),
        "int32": (ms.Tensor(np.array([3, -1, 4], np.int32)), True),
        "float16": (ms.Tensor(np.array([0.5, -2.0], np.float16)), True),
        "bool": (ms.Tensor(np.array([True, False, True])), True),
        "0-dim": (ms.Tensor(np.float32(2.5)), True),
        "empty": (ms.Tensor(np.zeros((0, 3), np.float32)), True),
    }
    for label, (tensor, direct) in cases.items():
        view = _direct_view(tensor, str(tensor.dtype))
        assert (view is not None) == direct, label
        expected = tensor.asnumpy().reshape(-1)
        got = _host_array(tensor, direct=True)
        assert got.dtype == expected.dtype and np.array_equal(got, expected), (label, got, expected)
    # The offset view starts at row 1, not at the storage's first element.
    assert _host_array(mint.narrow(base, 0, 1, 1), direct=True)[0] == 12 - 7.5


def test_tensor_statistics_read_through_views_when_execution_is_synchronous():
    # The test session runs with pynative_synchronize=True (conftest).
    assert direct_views_allowed()
    tensor = ms.Tensor(np.linspace(-1, 1, 70001, dtype=np.float32))
    stats = TensorStats(("min", "max", "mean", "norm", "zeros"), 1e-8, on_host=True)
    stats.add("actv", [("x", tensor)])
    assert stats._direct is True
    values = stats.results()[0][4][0]
    flat = tensor.asnumpy().astype(np.float64)
    want = [flat.min(), flat.max(), flat.mean(), np.sqrt((flat * flat).sum()),
            np.count_nonzero(np.abs(tensor.asnumpy()) < np.float32(1e-8)) / flat.size]
    # float32 accumulation: the mean within ~1e-7 of max|x| (= 1 here), the rest to relative 1e-6
    assert np.allclose(values, want, rtol=1e-6, atol=1e-7), (values, want)
    assert want[4] > 0   # linspace through 0 holds an exact zero: a zero count that could be wrong
