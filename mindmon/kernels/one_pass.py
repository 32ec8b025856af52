"""Sum, sum of squares, count of |x| < eps, min and max of a float array, read once, in one compiled loop.

numpy takes each of these in a pass of its own, and its float min/max are not vectorised on the x86
machines measured: about 1.5 ns per element for msprobe's six statistics, against 0.2-0.4 ns in cache
for this loop (numba, LLVM's vectoriser). Two choices let it vectorise:
- min and max are taken on the bit patterns, which integer SIMD reduces without NaN rules: the largest
  signed pattern is the largest float when it is non-negative, and the smallest / largest unsigned
  patterns are the smallest positive / most negative floats. NaN patterns sort among these, so a
  caller that sees a non-finite sum takes min/max again with NaN rules (`numpy.minimum.reduce`).
- sums are kept in `zero`'s type per 4096-element block (float32 lanes for a large float32 array:
  relative error about 1e-7, the precision of the data; float64 for a small one), blocks added in
  float64.

`reductions` takes a numpy array, `reductions_at` memory at an address (a CPU tensor's data pointer: no
array is built around it). numba is imported, and the loop compiled (mindmon.kernels.compiled, cached on disk), on
the first call or at `prepare()`: code that never takes these statistics never pays for it.
"""
from typing import Dict, NamedTuple, Tuple

import numpy as np

from mindmon.kernels.split import split_call


class Reductions(NamedTuple):
    total: float        # sum; not finite when the array holds NaN or +-inf, or the float32 blocks overflowed
    squares: float      # sum of squares; not finite likewise
    small: int          # elements with |x| < eps
    minimum: float      # NaN rules not applied: see the module docstring
    maximum: float


_BIT_VIEWS = {4: (np.int32, np.uint32), 8: (np.int64, np.uint64)}
_WIDE_ZERO = np.float64(0)
# numpy scalars of eps and 0 per (dtype, eps): making them costs a microsecond per tensor otherwise
_SCALARS: Dict[Tuple[np.dtype, float], Tuple[np.generic, np.generic]] = {}


def reductions(flat: np.ndarray, eps: float, wide: bool) -> Reductions:
    """One pass over a non-empty flat float32 or float64 array; `wide`: per-block sums in float64."""
    signed, unsigned = _BIT_VIEWS[flat.dtype.itemsize]
    eps_value, zero = _scalars(flat.dtype, eps, wide)
    return _found(*_compiled().array_loop(flat, flat.view(signed), flat.view(unsigned), eps_value, zero))


# What `reductions_at` writes, by code: the index of each name here.
ROW_STATISTICS = ("min", "max", "mean", "norm", "zeros", "nans", "id")


def reductions_at(table: np.ndarray, eps: float, small_size: int, codes: np.ndarray, n_rows: int
                  ) -> Tuple[np.ndarray, np.ndarray]:
    """The statistics of many float32 tensors in one call, from their memory: `table` is int64 [4 * tensors],
    (row, address, size > 0, scalar) after one another, memory the caller keeps alive and unchanged during the
    call (CPU tensors' data pointers); `scalar` 1 marks a 0-dim tensor (size 1), whose `id` is its value;
    arrays of at most `small_size` elements are summed wide. Returns `rows`, float64 [n_rows, codes]: row
    `row` holds the statistics `codes` name (`ROW_STATISTICS`), unless the tensor holds NaN or inf; and the
    table positions of those, for the caller to take with NaN rules. Rows no tensor is given for are NaN.
    (Allocated in the compiled call: in a hook's context, each numpy call from Python costs microseconds.)"""
    return split_call(_compiled().float32_at, table, 4, table[2::4], 0, True,
                      (float(eps), small_size, codes, n_rows))   # eps a float: typed at once


def row_reductions_at(table: np.ndarray, eps: float, small_size: int, codes: np.ndarray, n_rows: int
                      ) -> Tuple[np.ndarray, np.ndarray]:
    """`reductions_at` for strided float32 tensors whose elements lie in equal runs (a slice of a wider
    tensor's last dimension, as a fused projection's output is split): `table` is int64 [5 * tensors],
    (row, address, runs, run length, stride between run starts in elements) after one another. Each run is
    read where it lies: no copy of the tensor is made."""
    return split_call(_compiled().rows_at, table, 5, table[2::5] * table[3::5], 0, True,
                      (float(eps), small_size, codes, n_rows))


def _scalars(dtype: np.dtype, eps: float, wide: bool) -> Tuple[np.generic, np.generic]:
    """eps in the data's precision (what |x| < eps compares), and the zero the block sums start from."""
    scalars = _SCALARS.get((dtype, eps))
    if scalars is None:
        scalars = _SCALARS[(dtype, eps)] = (dtype.type(eps), dtype.type(0))
    return scalars[0], _WIDE_ZERO if wide else scalars[1]


def _found(total, squares, small, minimum, maximum) -> Reductions:
    # + 0.0 in Python (the loop may drop it: nsz): -0.0 becomes 0.0, as numpy's min/max of [0.0, -0.0] give
    return Reductions(total, squares, small, minimum + 0.0, maximum + 0.0)


def prepare() -> None:
    """Imports numba and loads (or, the first time on a machine, compiles) the float32 loops now, by running
    them once on one element: 1-2.5 s here, which a monitor built before training keeps out of the first
    step it collects."""
    one = np.zeros(1, np.float32)
    for wide in (False, True):
        reductions(one, 1e-8, wide)
    reductions_at(np.array([0, one.ctypes.data, 1, 0], dtype=np.int64), 1e-8, 1, np.zeros(1, np.int64), 1)
    row_reductions_at(np.array([0, one.ctypes.data, 1, 1, 1], dtype=np.int64), 1e-8, 1, np.zeros(1, np.int64), 1)
    add_and_squares(one.copy(), one, True)
    adds_at(np.array([one.copy().ctypes.data, one.ctypes.data, 1, 1, 0], dtype=np.int64), 1e-8, 1,
            np.zeros(1, np.int64), 1)
    _compiled().rounded_texts(np.zeros(1), 1, 6)   # the CSV rows' numbers (mindmon.kernels.rounded_text)


_compiled_module = None


def _compiled():
    """`mindmon.kernels.compiled`: the loop compiled by numba (imported once per process, cached on disk)."""
    global _compiled_module
    if _compiled_module is None:
        from mindmon.kernels import compiled

        _compiled_module = compiled
    return _compiled_module


def add_and_squares(total: np.ndarray, micro: np.ndarray, first: bool) -> Tuple[float, float]:
    """`total += micro` (`total[:] = micro` when `first`) for flat float32 arrays, returning the sums of
    squares of `total` after and of `micro` (0.0 when `first`), in one read of each array: as fast as the
    add alone, where numpy's add and two BLAS dot products per cached block cost a third more. Sums in
    float32 per block (vector lanes), blocks added in float64, as `_one_pass` sums."""
    return _compiled().add_and_squares(total, micro, first)


def adds_at(table: np.ndarray, eps: float, small_size: int, codes: np.ndarray, n_rows: int
            ) -> Tuple[np.ndarray, np.ndarray]:
    """Many gradient adds in one call: `table` is int64 [5 * adds], (sum's address, gradient's address, size,
    first, row) after one another, float32 memory the caller keeps alive. Where `row` >= 0 the statistics
    `codes` name (as `reductions_at` takes them) of the sum just made go to `rows[row]`, read right after
    the add, while the sum is in cache. Returns `rows`, float64 [n_rows, codes] (NaN where no statistics
    were asked for), and the rows whose sums hold NaN or inf, left for the caller to take with NaN rules.
    One call for every gradient of a backward pass: a call per gradient from its hook cost several times
    its warm time (caches cold between MindSpore's kernels)."""
    return split_call(_compiled().adds_at, table, 5, table[2::5], 4, False, (float(eps), small_size, codes, n_rows))
