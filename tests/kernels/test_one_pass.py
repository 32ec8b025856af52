"""`one_pass.reductions` and `numpy_stats` on top of it, against float64 numpy: min and max taken from bit
patterns (every sign mix, -0.0, infinities, subnormals, the block edges), sums in float32 blocks and
in float64, counts below eps in the data's precision, NaN and overflow handed back to numpy, and
every dtype a tensor can have."""
import json
import math
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from mindmon.features.tensor_stats.monitor import numpy_stats
from mindmon.kernels import one_pass
from mindmon.kernels.one_pass import reductions, reductions_at

pytestmark = pytest.mark.ms27

ALL = ("min", "max", "mean", "norm", "zeros", "nans")


def reference(data: np.ndarray, eps: float) -> dict:
    flat = data.reshape(-1)
    wide = flat.astype(np.float64)
    below = np.abs(flat) < flat.dtype.type(eps) if flat.dtype.kind == "f" else np.abs(wide) < eps
    return {"min": float(wide.min()), "max": float(wide.max()), "mean": float(wide.sum() / wide.size),
            "norm": math.sqrt(float(np.dot(wide, wide))), "zeros": np.count_nonzero(below) / flat.size,
            "nans": float(np.count_nonzero(np.isnan(wide)))}


def assert_matches(data: np.ndarray, eps: float = 1e-8):
    got = dict(zip(ALL, numpy_stats(data.reshape(-1), ALL, eps)))
    want = reference(data, eps)
    # float32 sums of up to 4096 elements per block: an error of a few float32 roundings of the block's
    # magnitude (in the compiled loop's vector lanes fewer; run as plain Python, one after another).
    # Everything else is summed in float64.
    narrow = data.dtype == np.float32 and data.size > 4096
    magnitude = float(np.abs(data.astype(np.float64)).mean()) if data.size else 0.0
    for op in ALL:
        if math.isnan(want[op]):
            assert math.isnan(got[op]), (op, got[op])
        elif op in ("min", "max", "zeros", "nans"):
            assert got[op] == want[op], (op, got[op], want[op])   # exact: nothing is rounded
        elif op == "mean":
            tolerance = (1e-5 if narrow else 1e-12) * magnitude
            assert abs(got[op] - want[op]) <= tolerance, (op, got[op], want[op])
        else:
            assert got[op] == pytest.approx(want[op], rel=1e-5 if narrow else 1e-12), (op, got[op], want[op])


SIGNS = {
    "mixed": lambda rng, n: rng.standard_normal(n),
    "all_positive": lambda rng, n: rng.uniform(0.5, 3.0, n),
    "all_negative": lambda rng, n: -rng.uniform(0.5, 3.0, n),
    "negative_and_zero": lambda rng, n: np.minimum(-rng.uniform(0, 3.0, n), 0.0),
    "tiny_and_subnormal": lambda rng, n: rng.standard_normal(n) * 1e-39,
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [1, 2, 31, 4095, 4096, 4097, 8193, 100_003])
@pytest.mark.parametrize("signs", SIGNS, ids=str)
def test_every_statistic_against_float64_numpy(dtype, size, signs):
    rng = np.random.default_rng(size)
    data = SIGNS[signs](rng, size).astype(dtype)
    data[rng.integers(0, size, max(1, size // 50))] = 0.0
    assert_matches(data)


@pytest.mark.parametrize("position", [0, 4095, 4096, 9999])
def test_the_extremes_are_found_wherever_they_are(position):
    """The smallest and largest element planted at a block's first, last, and a later block's position."""
    data = np.linspace(-1.0, 1.0, 10000, dtype=np.float32)[::-1].copy()
    data[position], data[(position + 1) % data.size] = -7.5, 9.25
    got = dict(zip(ALL, numpy_stats(data, ("min", "max"), 1e-8)))
    assert (got["min"], got["max"]) == (-7.5, 9.25)


@pytest.mark.parametrize("values, low, high", [
    ([0.0, -0.0], 0.0, 0.0),
    ([-0.0], 0.0, 0.0),
    ([-5.0, -0.0], -5.0, 0.0),
    ([-np.inf, 1.0, np.inf], -np.inf, np.inf),
    ([-np.inf, -1.0], -np.inf, -1.0),
    ([np.inf], np.inf, np.inf),
    ([1e-45, -1e-45], -1e-45, 1e-45),
    ([-3.4e38, 3.4e38], -3.4e38, 3.4e38),
])
def test_signed_zeros_infinities_and_subnormals(values, low, high):
    data = np.array(values, np.float32)
    found = reductions(data, 1e-8, wide=True)
    assert (found.minimum, found.maximum) == (float(np.float32(low)), float(np.float32(high)))
    # numpy's min/max of [0.0, -0.0] can be either zero; reductions gives +0.0 for both, never -0.0
    assert math.copysign(1.0, found.minimum) == math.copysign(1.0, float(data.min()) + 0.0)
    assert math.copysign(1.0, found.maximum) == math.copysign(1.0, float(data.max()) + 0.0)


@pytest.mark.parametrize("size", [10, 5000])
def test_nan_gives_nan_min_max_mean_norm_and_is_counted(size):
    data = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    data[[3, size - 1]] = np.nan
    got = dict(zip(ALL, numpy_stats(data, ALL, 1e-8)))
    assert all(math.isnan(got[op]) for op in ("min", "max", "mean", "norm"))
    assert got["nans"] == 2.0
    assert got["zeros"] == 0.0


def test_infinities_of_both_signs_without_nan():
    data = np.array([1.0, np.inf, -np.inf, 2.0] * 2000, np.float32)
    got = dict(zip(ALL, numpy_stats(data, ALL, 1e-8)))
    assert (got["min"], got["max"], got["nans"], got["norm"]) == (-np.inf, np.inf, 0.0, np.inf)
    assert math.isnan(got["mean"])


def test_float32_block_sums_that_overflow_are_redone_in_float64():
    """8192 elements of 1e38: each float32 block sum overflows, the float64 sums do not."""
    data = np.full(8192, 1e38, np.float32)
    data[::2] = 3e38
    assert_matches(data)


def test_large_float32_arrays_sum_to_float32_precision():
    """Over 4096 elements the sums are float32 per 4096-element block: relative error about 1e-7."""
    rng = np.random.default_rng(5)
    data = (rng.standard_normal(1_000_003) + 0.01).astype(np.float32)
    found = reductions(data, 1e-8, wide=False)
    wide = data.astype(np.float64)
    assert found.total == pytest.approx(wide.sum(), rel=1e-5)
    assert found.squares == pytest.approx(np.dot(wide, wide), rel=1e-6)


def test_zeros_compare_in_the_data_precision():
    """eps = 1e-8 is rounded to float32 for float32 data, as numpy compares a float32 array with it."""
    edge = np.float32(1e-8)
    data = np.array([edge, np.nextafter(edge, np.float32(0)), -edge, 0.0, 1.0] * 1000, np.float32)
    got = numpy_stats(data, ("zeros",), 1e-8)[0]
    assert got == np.count_nonzero(np.abs(data) < edge) / data.size == 0.4


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int64, np.int8, np.uint8, np.bool_])
def test_other_dtypes_are_taken_as_float64(dtype):
    data = (np.arange(-600, 600) % 7 - 3).astype(dtype)
    assert_matches(data, eps=0.5)


def test_the_float32_and_float64_sums_of_one_array_agree():
    """The same data through both block widths: they differ only by float32 rounding."""
    data = np.random.default_rng(9).standard_normal(50_000).astype(np.float32)
    narrow, wide = reductions(data, 1e-8, wide=False), reductions(data, 1e-8, wide=True)
    assert (narrow.minimum, narrow.maximum, narrow.small) == (wide.minimum, wide.maximum, wide.small)
    assert narrow.total == pytest.approx(wide.total, rel=1e-4, abs=1e-3)
    assert wide.total == pytest.approx(float(data.astype(np.float64).sum()), rel=1e-12)


@pytest.mark.parametrize("dtype, size", [(np.float32, 100), (np.float32, 5000), (np.float64, 5000)])
def test_a_dtype_and_eps_not_seen_before(monkeypatch, dtype, size):
    """As in a fresh process (no eps or zero scalars remembered): the pair asked for is made and used,
    on both sum widths, against float64 numpy."""
    monkeypatch.setattr(one_pass, "_SCALARS", {})
    data = np.random.default_rng(size).uniform(-1.0, 1.0, size).astype(dtype)
    wide64 = data.astype(np.float64)
    for wide in (False, True):
        found = reductions(data, 0.25, wide)
        rel = 1e-5 if dtype == np.float32 and not wide else 1e-12
        assert found.small == np.count_nonzero(np.abs(wide64) < 0.25) > 0
        assert found.total == pytest.approx(wide64.sum(), rel=rel)
        assert found.squares == pytest.approx(np.dot(wide64, wide64), rel=rel)
        assert (found.minimum, found.maximum) == (wide64.min(), wide64.max())


def test_narrow_sums_are_float32_numbers_and_wide_ones_exact():
    """wide=False keeps a block's sums in float32, whatever order the loop adds in: 4095 copies of
    float32(0.1) sum to a number no float32 holds (409.5000061...), so the narrow total is a float32
    rounding of it; in float64 every partial sum is exact (36 significant bits)."""
    data = np.full(4095, 0.1, np.float32)
    exact = 4095 * float(data[0])
    assert float(np.float32(exact)) != exact
    narrow, wide = reductions(data, 1e-8, wide=False), reductions(data, 1e-8, wide=True)
    assert float(np.float32(narrow.total)) == narrow.total == pytest.approx(exact, rel=1e-4)   # 4095 roundings
    assert float(np.float32(narrow.squares)) == narrow.squares
    assert wide.total == exact


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [50, 5000])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["plus_nan", "minus_nan"])
def test_nan_of_either_sign_makes_min_and_max_nan(dtype, size, sign):
    """A NaN made by arithmetic (inf - inf on x86) has its sign bit set: as a bit pattern it sorts among the
    most negative numbers, a NaN with the sign bit clear among the largest; min and max are NaN for both."""
    data = np.random.default_rng(size).standard_normal(size).astype(dtype)
    data[size // 3] = np.copysign(dtype(np.nan), dtype(sign))
    assert math.copysign(1.0, data[size // 3]) == sign
    low, high, nans = numpy_stats(data, ("min", "max", "nans"), 1e-8)
    assert math.isnan(low) and math.isnan(high) and nans == 1.0


@pytest.fixture
def fresh_compilation(monkeypatch):
    """`one_pass_jit` imported again (new dispatchers, as in a new process), and again after the test, so
    that a patched numba does not stay in the compiled loops other tests use."""
    import importlib

    from mindmon.kernels import compiled as one_pass_jit

    yield lambda: monkeypatch.setattr(one_pass, "_compiled_module", importlib.reload(one_pass_jit))
    monkeypatch.undo()
    importlib.reload(one_pass_jit)
    one_pass._compiled_module = one_pass_jit


ROW = ("min", "max", "mean", "norm", "zeros", "nans", "id")


def by_address(arrays, eps: float = 1e-8, small_size: int = 4096, ops=ROW):
    """`reductions_at` over the arrays' memory: (rows in `ops` order, positions it left to the caller)."""
    table = np.array([(k, a.ctypes.data, a.size, 0) for k, a in enumerate(arrays)], dtype=np.int64).reshape(-1)
    rows, redo = reductions_at(table, eps, small_size, np.array([one_pass.ROW_STATISTICS.index(op) for op in ops]),
                               len(arrays))
    return rows, redo.tolist()


def both_forms_match(data: np.ndarray):
    """The array form (through numpy_stats) and the address form give float64 numpy's numbers."""
    assert_matches(data)
    rows, redo = by_address([data], small_size=0)
    assert redo == [] and rows[0].tolist()[:6] == numpy_stats(data, ALL, 1e-8) and math.isnan(rows[0][6])


@pytest.mark.skipif(numba.config.DISABLE_JIT, reason="nothing is compiled with NUMBA_DISABLE_JIT=1")
def test_the_loop_is_cached_on_disk_where_numba_can_write(fresh_compilation):
    """Compiled once, then loaded from numba's disk cache by later processes (seconds saved at each start)."""
    from numba.core import caching

    fresh_compilation()
    both_forms_match(np.random.default_rng(4).standard_normal(5000).astype(np.float32))
    compiled = one_pass._compiled()
    for loop in (compiled.array_loop, compiled.statistics_row, compiled.float32_at):
        assert not isinstance(loop._cache, caching.NullCache)


@pytest.mark.skipif(numba.config.DISABLE_JIT, reason="nothing is compiled with NUMBA_DISABLE_JIT=1")
def test_compiles_without_a_writable_cache(monkeypatch, fresh_compilation):
    """No cache location numba can write to (a read-only install and home): the loop is compiled for the
    process instead, and the numbers are the same."""
    from numba.core import caching

    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", [])
    fresh_compilation()
    both_forms_match(np.random.default_rng(3).standard_normal(5000).astype(np.float32))
    compiled = one_pass._compiled()
    for loop in (compiled.array_loop, compiled.statistics_row, compiled.float32_at):
        assert isinstance(loop._cache, caching.NullCache)   # compiled, not cached


_BOTH_WAYS = """
import json
import numpy as np
from mindmon.features.tensor_stats.monitor import numpy_stats
from mindmon.kernels.one_pass import ROW_STATISTICS, reductions_at
ops = ("min", "max", "mean", "norm", "zeros")
found = []
for size in (5000, 100_003):
    data = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    table = np.array([0, data.ctypes.data, size, 0], dtype=np.int64)
    rows, _ = reductions_at(table, 1e-8, 4096, np.array([ROW_STATISTICS.index(op) for op in ops]), 1)
    found.append([numpy_stats(data, ops, 1e-8), rows[0].tolist()])
print(json.dumps(found))
"""


@pytest.mark.skipif(numba.config.DISABLE_JIT, reason="nothing is compiled with NUMBA_DISABLE_JIT=1")
def test_an_array_gets_the_same_numbers_both_ways_when_the_code_comes_from_the_disk_cache(tmp_path):
    """numba's code loaded from its disk cache was seen to add differently from code just compiled (the last
    float32 bit of a sum), so `numpy_stats` takes finite float32 arrays through the address form: in a
    process that compiles the loops and in one that loads them, both ways give an array the same numbers."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    for process in ("compiles", "loads from the cache"):
        done = subprocess.run([sys.executable, "-c", _BOTH_WAYS], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        for array_form, address_form in json.loads(done.stdout.splitlines()[-1]):
            assert array_form == address_form, process
        assert list(tmp_path.rglob("*float32_at*.nbi")), "nothing was cached"


def test_the_address_form_gives_numpy_stats_numbers():
    """`reductions_at` over arrays' memory writes exactly the numbers `numpy_stats` gives (which takes finite
    float32 arrays through it, and which the tests above hold against float64 numpy), each array summed
    wide up to `small_size` elements and narrow above, each into the row it is told; from an offset
    address it reads only what it is told; arrays holding NaN or inf are left to the caller, their rows NaN."""
    rng = np.random.default_rng(11)
    arrays = [rng.standard_normal(size + 7).astype(np.float32)[3:3 + size]
              for size in (1, 4095, 4096, 4097, 100_003, 50, 60)]
    arrays[0][0] = -0.0
    arrays[5][20], arrays[6][0] = np.nan, -np.inf
    ops = ("nans", "zeros", "norm", "mean", "max", "min", "id")
    order = np.array([8, 0, 3, 1, 6, 2, 4])   # rows given out of order, two left alone
    table = np.array([(row, a.ctypes.data, a.size, 0) for row, a in zip(order, arrays)], dtype=np.int64).reshape(-1)
    rows, redo = reductions_at(table, 0.5, 4096, np.array([one_pass.ROW_STATISTICS.index(op) for op in ops]), 9)
    assert redo.tolist() == [5, 6]
    for k, data in enumerate(arrays[:5]):
        got = rows[order[k]].tolist()
        assert got[:6] == numpy_stats(data, ops[:6], 0.5) and math.isnan(got[6])
    assert math.copysign(1.0, rows[8][5]) == 1.0 and rows[8][5] == 0.0   # -0.0 reported as 0.0
    assert rows.shape == (9, 7) and np.isnan(rows[[2, 4, 5, 7]]).all()   # NaN / inf rows, rows not given


def test_a_0_dim_tensors_id_is_its_value_and_other_ids_are_nan():
    """A table entry marked scalar (a 0-dim tensor) gets its one value as `id`, exactly (float32 values of
    every magnitude, negative zero as 0.0 like min/max); a one-element array not so marked gets NaN, as
    numpy_stats gives for anything with a dimension; a non-finite scalar is left to the caller."""
    values = np.array([0.1, -3.3e38, 1.4e-45, -0.0, 7.0, np.inf], dtype=np.float32)
    table = np.array([(k, values[k:].ctypes.data, 1, 1) for k in range(6)] + [(6, values[4:].ctypes.data, 1, 0)],
                     dtype=np.int64).reshape(-1)
    ops = ("id", "min", "mean")
    rows, redo = reductions_at(table, 1e-8, 4096, np.array([one_pass.ROW_STATISTICS.index(op) for op in ops]), 7)
    assert redo.tolist() == [5]
    for k in range(5):
        assert rows[k].tolist() == numpy_stats(values[k:k + 1], ops, 1e-8, scalar=True)
        assert rows[k][0] == float(values[k])
    assert math.isnan(rows[6][0]) and rows[6][1:].tolist() == [7.0, 7.0]


def test_numba_is_loaded_when_a_host_statistics_monitor_is_built_and_not_before():
    """Importing mindmon and its statistics monitor does not import numba; building a host-side statistics
    monitor does, with the compiled loops, before any step; a device-side one does not. (The CPU training
    step's gradient buffer loads them too when it is built: next test.)"""
    script = (
        "import sys\n"
        "from mindmon.features.tensor_stats.monitor import TensorStatsMonitor\n"
        "import mindmon, mindmon.features.train_state.monitor\n"
        "assert 'numba' not in sys.modules\n"
        "TensorStatsMonitor(('min',), on_host=False)\n"
        "assert 'numba' not in sys.modules\n"
        "TensorStatsMonitor(('min',), on_host=True)\n"
        "from mindmon.kernels import compiled as jit\n"
        "assert 'numba' in sys.modules\n"
        "print('python' if not hasattr(jit.float32_at, 'signatures') else\n"
        "      (sorted(str(sig[0]) for sig in jit.array_loop.signatures), len(jit.float32_at.signatures)))\n")
    last = _last_line_printed(script)
    if numba.config.DISABLE_JIT:
        assert last.endswith("python")
    else:   # both float32 sum widths loaded, and the address form
        assert last == "(['array(float32, 1d, C)', 'array(float32, 1d, C)'], 1)", last


def test_the_address_form_compares_eps_in_float32():
    """|x| < eps as float32 data compares it: eps rounded to float32 first. 1e-8 rounds down, so an element
    equal to float32(1e-8) is not below it (compared in float64 it would be)."""
    eps = 1e-8
    data = np.array([np.float32(eps), 0.0, -np.float32(eps), 1.0], dtype=np.float32)
    rows, redo = by_address([data], eps=eps, ops=("zeros",))
    want = np.count_nonzero(np.abs(data) < np.float32(eps)) / data.size
    assert redo == [] and rows[0][0] == want == 0.25


def test_the_address_form_reports_a_largest_element_of_minus_zero_as_zero():
    """Every element negative or -0.0: the max is -0.0, reported as +0.0 (numpy's max of [0.0, -0.0])."""
    data = np.array([-2.0, -0.0, -1.5], dtype=np.float32)
    rows, redo = by_address([data], ops=("max", "min"))
    assert redo == [] and rows[0].tolist() == [0.0, -2.0]
    assert math.copysign(1.0, rows[0][0]) == 1.0


def test_the_address_form_hands_back_float32_squares_that_overflow():
    """Above `small_size` the squares are summed in float32 blocks: 1e20 squared overflows float32 although
    the sum does not, so the array goes back to the caller (which sums the squares in float64)."""
    data = np.zeros(10, dtype=np.float32)
    data[3] = 1e20
    with np.errstate(over="ignore"):   # run as plain Python (NUMBA_DISABLE_JIT=1) numpy warns of it
        rows, redo = by_address([data], small_size=4, ops=("norm", "mean"))
    assert redo == [0] and np.isnan(rows[0]).all()
    rows, redo = by_address([data], small_size=10, ops=("norm", "mean"))   # summed in float64: no overflow
    wide = data.astype(np.float64)
    assert redo == [] and rows[0].tolist() == [math.sqrt(float(np.dot(wide, wide))), float(wide.sum()) / 10]


def test_the_cpu_training_steps_buffer_loads_the_compiled_add_when_built():
    """AccumulatingTrainStep's host buffer adds gradients and takes their norms in `add_and_squares`: the
    loops are loaded when the buffer is built, before the first step, not in it."""
    script = (
        "import sys, numpy as np\n"
        "from mindspore import Tensor\n"
        "from mindmon.kernels.stats import HostGradientBuffer\n"
        "assert 'numba' not in sys.modules\n"
        "HostGradientBuffer([Tensor(np.zeros(3, np.float32))])\n"
        "from mindmon.kernels import compiled as jit\n"
        "print('numba' in sys.modules, 'python' if not hasattr(jit.add_and_squares, 'signatures') else\n"
        "      len(jit.add_and_squares.signatures))\n")
    assert _last_line_printed(script).split() == ["True", "python" if numba.config.DISABLE_JIT else "1"]


def _last_line_printed(script: str) -> str:
    """Runs `script` in a fresh Python (what a new process imports); its last line of output."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_add_and_squares_against_float64_numpy():
    """The fused add: `total` becomes the float32 sum exactly as numpy adds it, and the two sums of squares
    are float64 numpy's of the same float32 values; sizes across 4096-element block edges; `first` copies
    and reports no micro-batch norm. Small integers first, whose float32 block sums are exact in any order
    (so one element left out or counted twice shows); then normal values, to float32 rounding of each block
    (about 1e-7 compiled; about 2e-6 as plain Python under NUMBA_DISABLE_JIT=1, summed in sequence)."""
    from mindmon.kernels.one_pass import add_and_squares

    rng = np.random.default_rng(8)
    for exact in (True, False):
        for size in (1, 4095, 4096, 4097, 3 * 4096 + 5, 100_003):
            micro = [(rng.integers(-3, 4, size=size) if exact else rng.normal(0.2 * k, 1.0 + k, size=size))
                     .astype(np.float32) for k in range(3)]
            total, expected = np.full(size, np.nan, np.float32), np.zeros(size, np.float32)
            for k, gradient in enumerate(micro):
                expected = gradient.copy() if k == 0 else expected + gradient
                accumulated, own = add_and_squares(total, gradient, k == 0)
                assert np.array_equal(total, expected), size
                wide, mine = expected.astype(np.float64), gradient.astype(np.float64)
                tolerance = 0.0 if exact else 1e-5
                assert abs(accumulated - np.dot(wide, wide)) <= tolerance * np.dot(wide, wide), (exact, size, k)
                assert own == 0.0 if k == 0 else abs(own - np.dot(mine, mine)) <= tolerance * np.dot(mine, mine)


def test_adds_at_copies_then_adds_what_lies_at_the_addresses_and_takes_the_finished_sums_statistics():
    """The gradient hooks' queue added in one call: `first` copies, later adds, exactly as numpy adds float32
    (sizes across the loop's vector width, several sums in one table); only `size` values are read at each
    address; a row >= 0 gets `numpy_stats` of the sum just made, one holding NaN is handed back untouched."""
    from mindmon.kernels.one_pass import adds_at
    from mindmon.kernels.stats import SMALL

    rng = np.random.default_rng(9)
    sizes = (1, 7, 8, 9, 4097, 100_003)
    micro = {size: [rng.normal(0.0, 1.0 + k, size=size + 1).astype(np.float32) for k in range(3)] for size in sizes}
    for gradients in micro.values():
        for gradient in gradients:
            gradient[-1] = np.nan   # one past the end: must not reach the sum
    micro[9][2][4] = np.nan         # this sum holds a NaN: its statistics are left to numpy's rules
    totals = {size: np.full(size, np.nan, np.float32) for size in sizes}
    expected = {}
    codes = np.arange(6, dtype=np.int64)
    for k in range(3):
        last = k == 2
        table = np.array([value for row, size in enumerate(sizes) for value in
                          (totals[size].ctypes.data, micro[size][k].ctypes.data, size, k == 0, row if last else -1)],
                         dtype=np.int64)
        rows, redo = adds_at(table, 1e-8, SMALL, codes, len(sizes))
        for size in sizes:
            expected[size] = micro[size][k][:size].copy() if k == 0 else expected[size] + micro[size][k][:size]
            assert np.array_equal(totals[size], expected[size], equal_nan=True), (size, k)
        if not last:
            assert redo.size == 0 and np.isnan(rows).all()   # no statistics asked for
    assert redo.tolist() == [sizes.index(9)] and np.isnan(rows[sizes.index(9)]).all()
    for row, size in enumerate(sizes):
        if size != 9:
            assert rows[row].tolist() == numpy_stats(expected[size], ALL[:6], 1e-8), size


def test_float32_sums_take_float32_values_as_they_are():
    """The compiled loop adds no run-time 0 to a float32 value summed in float32 (a sixth of its time); a
    float32 value summed in float64 is widened. -0.0 tells which: 0 + -0.0 is 0.0."""
    from numba import types

    from mindmon.kernels.compiled import in_sums_precision_compiled

    as_it_is = in_sums_precision_compiled(types.float32, types.float32)
    widened = in_sums_precision_compiled(types.float64, types.float32)
    assert repr(float(as_it_is(np.float32(0), np.float32(-0.0)))) == "-0.0"
    result = widened(0.0, np.float32(-0.0))
    assert repr(result) == "0.0" and isinstance(result, float)


def test_the_runs_form_reads_strided_memory_as_float64_numpy_gives():
    """`row_reductions_at` over slices of a wider matrix's last dimension (as a fused projection's output is
    split): each slice's statistics against float64 numpy of the slice's own elements, so a value read from
    a neighbouring column, or one run too many, would show; min/max exact, -0.0 as 0.0; small slices summed
    wide, large ones in float32; a slice holding NaN or inf is left to the caller."""
    rng = np.random.default_rng(5)
    wide = rng.standard_normal((300, 3 * 64)).astype(np.float32)
    wide[7, 64 + 5] = -0.0
    wide[0, 64] = -50.0                     # the middle slice's minimum, in its first run's first element
    wide[299, 191] = 60.0                   # the last slice's maximum, in its last run's last element
    holed = rng.standard_normal((4, 30)).astype(np.float32)
    holed[2, 11] = np.nan
    slices = [wide[:, 64:128], wide[:, 128:], wide[:10, :3], holed[:, 10:20]]
    table = np.array([(k, s.ctypes.data, s.shape[0], s.shape[1], s.strides[0] // 4) for k, s in enumerate(slices)],
                     dtype=np.int64).reshape(-1)
    rows, redo = one_pass.row_reductions_at(table, 0.5, 4096,
                                            np.array([one_pass.ROW_STATISTICS.index(op) for op in ALL]), 4)
    assert redo.tolist() == [3] and np.isnan(rows[3]).all()
    for k, piece in enumerate(slices[:3]):
        want = reference(np.ascontiguousarray(piece), 0.5)
        got = dict(zip(ALL, rows[k].tolist()))
        assert [got[op] for op in ("min", "max", "zeros", "nans")] == [want[op] for op in ("min", "max", "zeros", "nans")]
        scale = float(np.abs(piece.astype(np.float64)).mean())
        assert abs(got["mean"] - want["mean"]) <= 1e-6 * scale, (k, got, want)
        assert math.isclose(got["norm"], want["norm"], rel_tol=1e-6), (k, got, want)
    assert rows[0][0] == -50.0 and rows[1][1] == 60.0
