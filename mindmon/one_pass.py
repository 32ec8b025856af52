"""Sum, sum of squares, count of |x| < eps, min and max of a float array, read once, in one compiled loop.

numpy takes each of these in a pass of its own, and its float min/max are not vectorised on the x86
machines measured: about 1.5 ns per element for msprobe's six statistics, against about 0.4 ns for
this loop (numba, LLVM's vectoriser). Two choices let it vectorise:
- min and max are taken on the bit patterns, which integer SIMD reduces without NaN rules: the largest
  signed pattern is the largest float when it is non-negative, and the smallest / largest unsigned
  patterns are the smallest positive / most negative floats. NaN patterns sort among these, so a
  caller that sees a non-finite sum takes min/max again with NaN rules (`numpy.minimum.reduce`).
- sums are kept in `zero`'s type per 4096-element block (float32 lanes for a large float32 array:
  relative error about 1e-7, the precision of the data; float64 for a small one), blocks added in
  float64.

numba is imported, and the loop compiled (cached on disk), on the first call: code that never takes
these statistics never pays for it.
"""
from typing import Dict, NamedTuple, Tuple

import numpy as np

# Elements per partial sum: 16 KiB of float32 stays in L1 while all five reductions read it.
_BLOCK = 4096


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
    scalars = _SCALARS.get((flat.dtype, eps))
    if scalars is None:
        scalars = _SCALARS[(flat.dtype, eps)] = (flat.dtype.type(eps), flat.dtype.type(0))
    total, squares, small, minimum, maximum = _compiled()(flat, flat.view(signed), flat.view(unsigned),
                                                          scalars[0], _WIDE_ZERO if wide else scalars[1])
    # + 0.0 in Python (the loop may drop it: nsz): -0.0 becomes 0.0, as numpy's min/max of [0.0, -0.0] give
    return Reductions(total, squares, small, minimum + 0.0, maximum + 0.0)


_kernel = None


def _compiled():
    """`_one_pass` compiled by numba (once per process; cached on disk across processes)."""
    global _kernel
    if _kernel is None:
        import numba

        # Reassociation lets the sums use vector lanes, nsz drops the widening of float32 values into
        # float32 sums; no nnan/ninf: NaN and inf keep their meaning.
        options = dict(fastmath={"reassoc", "contract", "arcp", "nsz"}, nogil=True, boundscheck=False)
        try:
            _kernel = numba.njit(cache=True, **options)(_one_pass)
        except RuntimeError:   # nowhere writable to cache it (read-only install, no home): compile per process
            _kernel = numba.njit(cache=False, **options)(_one_pass)
    return _kernel


def _one_pass(values, signed, unsigned, eps, zero):
    """The loop numba compiles (plain Python here, so it also runs as written with NUMBA_DISABLE_JIT=1)."""
    total = squares = 0.0
    small = 0
    signed_max, unsigned_min, unsigned_max = signed[0], unsigned[0], unsigned[0]
    for start in range(0, values.size, _BLOCK):
        block_total, block_squares, block_small = zero, zero, np.float32(0)   # 4096 counts exactly
        for i in range(start, min(start + _BLOCK, values.size)):
            value = values[i]
            widened = zero + value   # in the sums' precision before it is squared
            block_total += widened
            block_squares += widened * widened
            block_small += np.float32(abs(value) < eps)
            signed_max = signed[i] if signed[i] > signed_max else signed_max
            unsigned_min = unsigned[i] if unsigned[i] < unsigned_min else unsigned_min
            unsigned_max = unsigned[i] if unsigned[i] > unsigned_max else unsigned_max
        total += block_total
        squares += block_squares
        small += int(block_small)
    extremes = np.empty(2, unsigned.dtype)   # [min, max] as bit patterns; separate stores: no int/uint mix
    if unsigned_max >> np.uint8(8 * values.itemsize - 1):   # the sign bit: the most negative element
        extremes[0] = unsigned_max
    else:
        extremes[0] = unsigned_min
    if signed_max >= 0:
        extremes[1] = signed_max
    else:                                            # every element negative: the one nearest 0
        extremes[1] = unsigned_min
    minimum, maximum = extremes.view(values.dtype)
    return total, squares, small, minimum, maximum
