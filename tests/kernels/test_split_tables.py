"""Large statistics tables split between threads (`mindmon.kernels.split`): every row as float64 numpy gives
it and bit for bit what the calling thread alone gives (the tensors are reduced whole, whoever reduces
them), NaN tensors handed back at their table positions (or rows, for the adds), a failure in a helper
raised in the caller, and the cuts balanced."""
import math
import threading

import numpy as np
import pytest

from mindmon.kernels import compiled, one_pass, split
from mindmon.kernels.stats import SMALL

pytestmark = pytest.mark.ms27

CODES = np.arange(6, dtype=np.int64)   # min, max, mean, norm, zeros, nans


def arrays(count=24, seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(60_000, 200_000, count)
    return [rng.standard_normal(int(n)).astype(np.float32) * (k + 1) for k, n in enumerate(sizes)]


def assert_float64_row(row, array):
    """min, max, zeros and nans exact; the float32 block sums to float32 precision of the magnitudes."""
    wide = array.astype(np.float64).reshape(-1)
    want = [wide.min(), wide.max(), wide.mean(), math.sqrt(np.dot(wide, wide)),
            np.count_nonzero(np.abs(array) < np.float32(1e-3)) / array.size, 0.0]
    assert [row[0], row[1], row[4], row[5]] == [want[0], want[1], want[4], want[5]]
    assert abs(row[2] - want[2]) <= 1e-5 * float(np.abs(wide).mean())
    assert row[3] == pytest.approx(want[3], rel=1e-5)


def reversed_rows_table(data):
    """Rows named backwards, so that a merge that put pieces' rows by position would be caught."""
    n = len(data)
    return np.array([v for k, a in enumerate(data) for v in (n - 1 - k, a.ctypes.data, a.size, 0)], np.int64)


def test_a_large_table_is_split_and_its_rows_are_numpys_and_the_one_threads():
    data = arrays()
    table = reversed_rows_table(data)
    assert sum(a.size for a in data) >= split.MIN_ELEMENTS and split.parts(table[2::4]) >= 2
    rows, redo = one_pass.reductions_at(table, 1e-3, SMALL, CODES, len(data))
    alone, alone_redo = compiled.float32_at(table, 1e-3, SMALL, CODES, len(data))
    assert redo.size == 0 and alone_redo.size == 0
    assert np.array_equal(rows, alone)
    for k, array in enumerate(data):
        assert_float64_row(rows[len(data) - 1 - k], array)


def test_the_work_runs_on_another_thread_too(monkeypatch):
    seen = set()
    real = compiled.float32_at

    def recording(*arguments):
        seen.add(threading.get_ident())
        return real(*arguments)

    monkeypatch.setattr(compiled, "float32_at", recording)
    data = arrays()
    one_pass.reductions_at(reversed_rows_table(data), 1e-3, SMALL, CODES, len(data))
    assert len(seen) == split.parts(np.array([a.size for a in data]))
    assert len(seen) >= 2


def test_nan_tensors_come_back_at_their_table_positions_from_every_piece():
    data = arrays()
    poisoned = [2, len(data) - 3]   # one in the first piece, one in the last
    for k in poisoned:
        data[k][17] = np.nan
    table = reversed_rows_table(data)
    _, redo = one_pass.reductions_at(table, 1e-3, SMALL, CODES, len(data))
    assert sorted(redo.tolist()) == poisoned


def test_the_runs_form_splits_by_the_elements_of_each_tensor():
    rng = np.random.default_rng(3)
    wide = [rng.standard_normal((300, 3 * 256)).astype(np.float32) for _ in range(16)]
    parts = [w[:, 256:512] for w in wide]           # the middle third of each row
    table = np.array([v for k, (w, p) in enumerate(zip(wide, parts))
                      for v in (k, w.ctypes.data + 4 * 256, 300, 256, 768)], np.int64)
    assert split.parts(table[2::5] * table[3::5]) >= 2
    rows, redo = one_pass.row_reductions_at(table, 1e-3, SMALL, CODES, len(parts))
    assert redo.size == 0
    assert np.array_equal(rows, compiled.rows_at(table, 1e-3, SMALL, CODES, len(parts))[0])
    for k, part in enumerate(parts):
        assert_float64_row(rows[k], np.ascontiguousarray(part))


def test_split_adds_make_every_sum_and_give_the_finished_ones_rows():
    micro = arrays(seed=5)
    sums = [np.full(a.size, 0.5, np.float32) for a in micro]
    finishing = [k for k in range(len(micro)) if k % 3 == 0]   # rows for some sums only
    micro[finishing[-1]][4] = np.inf                           # one finished sum not finite: redone by row
    table = np.array([v for k, (s, m) in enumerate(zip(sums, micro))
                      for v in (s.ctypes.data, m.ctypes.data, s.size, 0,
                                finishing.index(k) if k in finishing else -1)], np.int64)
    assert split.parts(table[2::5]) >= 2
    rows, redo = one_pass.adds_at(table, 1e-3, SMALL, CODES, len(finishing))
    assert redo.tolist() == [len(finishing) - 1]
    for k, (total, added) in enumerate(zip(sums, micro)):
        assert np.array_equal(total, np.float32(0.5) + added)
    for row, k in enumerate(finishing[:-1]):
        assert_float64_row(rows[row], sums[k])


def test_a_failure_in_a_helper_is_raised_in_the_caller_after_every_piece_is_done(monkeypatch):
    real, calls = compiled.float32_at, []

    def failing_off_the_main_thread(table, *arguments):
        calls.append(table.size)
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("helper failed")
        return real(table, *arguments)

    monkeypatch.setattr(compiled, "float32_at", failing_off_the_main_thread)
    data = arrays()
    with pytest.raises(RuntimeError, match="helper failed"):
        one_pass.reductions_at(reversed_rows_table(data), 1e-3, SMALL, CODES, len(data))
    assert sum(calls) == 4 * len(data)   # every piece was run before the error reached the caller


@pytest.mark.parametrize("sizes, count", [([5, 5, 5, 5], 2), ([100, 1, 1, 1], 2), ([1, 1, 1, 100], 3),
                                          ([7] * 9, 4), ([1, 2], 2)])
def test_cuts_are_balanced_and_leave_no_piece_empty(sizes, count):
    bounds = split.cuts(np.array(sizes), count)
    assert bounds[0] == 0 and bounds[-1] == len(sizes) and len(bounds) == count + 1
    assert all(b > a for a, b in zip(bounds, bounds[1:]))
    pieces = [sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])]
    # no piece could give an element to a neighbour's side and make the largest smaller
    assert max(pieces) <= sum(sizes) / count + max(sizes)


def test_a_small_table_stays_on_the_calling_thread():
    assert split.parts(np.array([1000, 2000])) == 1
    assert split.parts(np.array([split.MIN_ELEMENTS])) == 1   # one tensor: nothing to split
