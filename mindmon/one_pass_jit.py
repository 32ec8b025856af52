"""numba's compilation of `one_pass._one_pass`, over a numpy array and over memory at an address, of the
training step's gradient add with its norms (`one_pass.add_and_squares`, driven from here), and of a
gradient hook's add from an address (`one_pass.add_at`).

The address form is for tensors: a tensor's data pointer goes straight into the compiled code, where
building a numpy array around it first (a ctypes buffer, `frombuffer`, two bit views) cost several
times what the loop itself costs over a tensor of a few thousand elements. Imported on the first
statistics a process takes (importing numba takes a second or two); the compiled code is cached on disk.

numba keys each cached function on its own file only: the functions compiled here carry one_pass.py's
loops inside them, so after editing one_pass.py (in a checkout; an install rewrites every file) the
cache must be cleared (`rm mindmon/__pycache__/*.nb[ic]`), or `float32_at` keeps the old loop.
"""
import ctypes

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic, overload

from .one_pass import (_BLOCK, _add_block, _copy_block, _copy_or_add, _in_sums_precision, _one_pass,
                       _statistics_row)

# Reassociation lets the sums use vector lanes, nsz ignores the sign of a zero sum (no zero is kept from
# them); no nnan/ninf: NaN and inf keep their meaning. Only the loop gets these: the statistics made
# from its sums must be the numbers numpy_stats gives.
FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


def _jit(function, fastmath: bool = False):
    options = dict(fastmath=FASTMATH if fastmath else False, nogil=True, boundscheck=False)
    try:
        return numba.njit(cache=True, **options)(function)
    except RuntimeError:   # nowhere writable to cache it (read-only install, no home): compile per process
        return numba.njit(cache=False, **options)(function)


def _pointer_to(item):
    """An intrinsic that makes an integer address a pointer to `item`s, which `numba.carray` takes."""
    @intrinsic
    def pointer(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(item)))
        return types.CPointer(item)(types.intp), codegen
    return pointer


@overload(_in_sums_precision, inline="always")
def _in_sums_precision_compiled(zero, value):
    """The value itself where it already has the sums' type: no add of a run-time 0 in the loop. (The loop's
    disk cache follows one_pass.py's changes, not this file's: a change here needs the cache cleared.)"""
    if zero == value:
        return lambda zero, value: value
    return lambda zero, value: zero + value


array_loop = _jit(_one_pass, fastmath=True)
_copy_block_loop = _jit(_copy_block, fastmath=True)
_add_block_loop = _jit(_add_block, fastmath=True)


def _add_and_squares(total, micro, first):
    """`one_pass.add_and_squares`, block by block; here, not in one_pass, because it calls the compiled
    block loops (with the loop inline LLVM did not vectorise it: 2.5x slower than numpy's add)."""
    accumulated = own = 0.0
    for start in range(0, total.size, _BLOCK):
        end = min(start + _BLOCK, total.size)
        if first:
            accumulated += _copy_block_loop(total[start:end], micro[start:end])
        else:
            block_accumulated, block_own = _add_block_loop(total[start:end], micro[start:end])
            accumulated += block_accumulated
            own += block_own
    return accumulated, own


add_and_squares = _jit(_add_and_squares)
statistics_row = _jit(_statistics_row)
_FLOAT32, _INT32, _UINT32 = (_pointer_to(item) for item in (types.float32, types.int32, types.uint32))


def _float32_at(table, eps, small_size, codes, n_rows):
    eps = np.float32(eps)   # what |x| < eps compares: eps in the data's precision
    rows = np.full((n_rows, codes.size), np.nan)
    redo = np.empty(table.size // 4, np.int64)
    count = 0
    for k in range(table.size // 4):
        row, address, size, scalar = table[4 * k], table[4 * k + 1], table[4 * k + 2], table[4 * k + 3]
        values = numba.carray(_FLOAT32(address), size)
        signed, unsigned = numba.carray(_INT32(address), size), numba.carray(_UINT32(address), size)
        if size <= small_size:   # summed in float64
            found = array_loop(values, signed, unsigned, eps, 0.0)
        else:                    # in float32 blocks
            found = array_loop(values, signed, unsigned, eps, np.float32(0))
        if not statistics_row(found, size, codes, rows[row], scalar != 0):
            redo[count] = k
            count += 1
    return rows, redo[:count]


def _python_float32_at(table, eps, small_size, codes, n_rows):
    """`_float32_at` as plain Python (NUMBA_DISABLE_JIT=1, where intrinsics do not exist)."""
    eps = np.float32(eps)
    rows = np.full((n_rows, codes.size), np.nan)
    redo = []
    for k, (row, address, size, scalar) in enumerate(table.reshape(-1, 4).tolist()):
        values = np.frombuffer((ctypes.c_char * (size * 4)).from_address(address), np.float32)
        zero = np.float64(0) if size <= small_size else np.float32(0)
        if not _statistics_row(_one_pass(values, values.view(np.int32), values.view(np.uint32), eps, zero),
                               size, codes, rows[row], scalar != 0):
            redo.append(k)
    return rows, np.array(redo, np.int64)


float32_at = _python_float32_at if numba.config.DISABLE_JIT else _jit(_float32_at)


_copy_or_add_loop = _jit(_copy_or_add, fastmath=True)


def _add_at(total, address, first):
    _copy_or_add_loop(total, numba.carray(_FLOAT32(address), total.size), first)


def _python_add_at(total, address, first):
    """`_add_at` as plain Python (NUMBA_DISABLE_JIT=1)."""
    micro = np.frombuffer((ctypes.c_char * (total.size * 4)).from_address(address), np.float32)
    _copy_or_add(total, micro, first)


add_at = _python_add_at if numba.config.DISABLE_JIT else _jit(_add_at)
