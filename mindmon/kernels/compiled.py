"""The statistics loops and their compilation by numba: the one-pass loop over a numpy array and over
memory at an address, the training step's gradient add with its norms, the gradient hooks' adds from
addresses. `mindmon.kernels.one_pass` is their API.

The loops are plain Python (they also run as written with NUMBA_DISABLE_JIT=1). The address form is for
tensors: a tensor's data pointer goes straight into the compiled code, where building a numpy array around
it first (a ctypes buffer, `frombuffer`, two bit views) cost several times what the loop itself costs over
a tensor of a few thousand elements. Imported on the first statistics a process takes (importing numba
takes a second or two); the compiled code is cached on disk.

Every loop and every function compiled from it are in this one file on purpose: numba keys each cached
function on the file that defines it (its modification time and size), and a compiled function carries the
loops it calls inside it. With the loops in another file, editing them left the cached functions of this
one running the old loops until someone cleared the cache; here any edit invalidates them all.
"""
import ctypes
import math

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic, overload


# Elements per partial sum: 16 KiB of float32 stays in L1 while all five reductions read it.
BLOCK = 4096


def in_sums_precision(zero, value):
    """`value` in the block sums' precision (`zero`'s type), before it is squared. Compiled, a float32 value
    summed in float32 is taken as it is (`in_sums_precision_compiled` says so to numba): adding a 0 known only at run
    time cost a sixth of the loop's time."""
    return zero + value


def one_pass_loop(values, signed, unsigned, eps, zero):
    """The loop numba compiles (plain Python here, so it also runs as written with NUMBA_DISABLE_JIT=1).
    Each block is read through slices, indexed from 0: indexed from `start`, the loop kept numba's check for
    negative indices and was not vectorised on an AVX-512 Xeon (1.3 ns per element in cache; the same
    indices as unsigned integers, which numba does not check, 0.24; slices 0.2-0.3: docs/performance.md)."""
    total = squares = 0.0
    small = 0
    signed_max, unsigned_min, unsigned_max = signed[0], unsigned[0], unsigned[0]
    for start in range(0, values.size, BLOCK):
        end = min(start + BLOCK, values.size)
        block, block_signed, block_unsigned = values[start:end], signed[start:end], unsigned[start:end]
        block_total, block_squares, block_small = zero, zero, np.float32(0)   # 4096 counts exactly
        for i in range(block.size):
            value = block[i]
            widened = in_sums_precision(zero, value)
            block_total += widened
            block_squares += widened * widened
            block_small += np.float32(abs(value) < eps)
            signed_max = max(block_signed[i], signed_max)
            unsigned_min = min(block_unsigned[i], unsigned_min)
            unsigned_max = max(block_unsigned[i], unsigned_max)
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


def copy_or_add(total, micro, first):
    """The add `adds_at` makes of each gradient (compiled alone: it vectorises)."""
    if first:
        for i in range(total.size):
            total[i] = micro[i]
    else:
        for i in range(total.size):
            total[i] += micro[i]


def copy_block(total, micro):
    """`total[:] = micro`; the sum of squares (float32). A loop of its own: compiled alone, it vectorises."""
    squares = np.float32(0)
    for i in range(total.size):
        value = micro[i]
        total[i] = value
        squares += value * value
    return squares


def add_block(total, micro):
    """`total += micro`; the sums of squares of `total` after and of `micro` (float32)."""
    accumulated, own = np.float32(0), np.float32(0)
    for i in range(total.size):
        value = micro[i]
        new = total[i] + value
        total[i] = new
        accumulated += new * new
        own += value * value
    return accumulated, own


def statistics_row_loop(found, size, codes, row, scalar=False) -> bool:
    """`one_pass_loop`'s result as the statistics `codes` name, into `row`; False (nothing written) when a sum is
    not finite. The arithmetic is `numpy_stats`' (compiled without fastmath: the same numbers). `scalar`: the
    values are a 0-dim tensor's one element, summed in float64, so `id` (its value) is the sum, exactly."""
    total, squares, small, minimum, maximum = found
    if not (np.isfinite(total) and np.isfinite(squares)):
        return False
    for j in range(codes.size):
        code = codes[j]
        if code == 0:
            row[j] = minimum + 0.0   # -0.0 becomes 0.0, as numpy's min/max of [0.0, -0.0] give
        elif code == 1:
            row[j] = maximum + 0.0
        elif code == 2:
            row[j] = total / size
        elif code == 3:
            row[j] = np.sqrt(squares)
        elif code == 4:
            row[j] = small / size
        elif code == 5:
            row[j] = 0.0             # a finite sum: no NaN
        elif scalar:
            row[j] = total           # `id`: a 0-dim tensor's value
        else:
            row[j] = np.nan          # `id` of a tensor with a dimension
    return True


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


@overload(in_sums_precision, inline="always")
def in_sums_precision_compiled(zero, value):
    """The value itself where it already has the sums' type: no add of a run-time 0 in the loop."""
    if zero == value:
        return lambda zero, value: value
    return lambda zero, value: zero + value


array_loop = _jit(one_pass_loop, fastmath=True)
_copy_block_loop = _jit(copy_block, fastmath=True)
_add_block_loop = _jit(add_block, fastmath=True)


def _add_and_squares(total, micro, first):
    """`one_pass.add_and_squares`, block by block, calling the block loops compiled alone (with the loop
    inline LLVM did not vectorise it: 2.5x slower than numpy's add)."""
    accumulated = own = 0.0
    for start in range(0, total.size, BLOCK):
        end = min(start + BLOCK, total.size)
        if first:
            accumulated += _copy_block_loop(total[start:end], micro[start:end])
        else:
            block_accumulated, block_own = _add_block_loop(total[start:end], micro[start:end])
            accumulated += block_accumulated
            own += block_own
    return accumulated, own


add_and_squares = _jit(_add_and_squares)
statistics_row = _jit(statistics_row_loop)
_FLOAT32, _INT32, _UINT32 = (_pointer_to(item) for item in (types.float32, types.int32, types.uint32))


def _statistics_at(address, size, eps, small_size, codes, row, scalar):
    """The statistics `codes` name of `size` float32 values at `address` into `row` (summed in float64 up
    to `small_size` values, in float32 blocks above); False, `row` untouched, when a sum is not finite.
    Every statistic of memory at an address goes through this one compiled function, so a tensor gets the
    same numbers whichever call took them."""
    values = numba.carray(_FLOAT32(address), size)
    signed, unsigned = numba.carray(_INT32(address), size), numba.carray(_UINT32(address), size)
    if size <= small_size:
        found = array_loop(values, signed, unsigned, eps, 0.0)
    else:
        found = array_loop(values, signed, unsigned, eps, np.float32(0))
    return statistics_row(found, size, codes, row, scalar)


def _python_statistics_at(address, size, eps, small_size, codes, row, scalar):
    """`_statistics_at` as plain Python (NUMBA_DISABLE_JIT=1, where intrinsics do not exist)."""
    values = _python_float32s(address, size)
    zero = np.float64(0) if size <= small_size else np.float32(0)
    return statistics_row_loop(one_pass_loop(values, values.view(np.int32), values.view(np.uint32), eps, zero),
                               size, codes, row, scalar)


statistics_at = _python_statistics_at if numba.config.DISABLE_JIT else _jit(_statistics_at)


def float32_at_loop(table, eps, small_size, codes, n_rows):
    """`one_pass.reductions_at`: the rows of a table of (row, address, size, scalar); the table positions of
    the tensors holding NaN or inf."""
    eps = np.float32(eps)   # what |x| < eps compares: eps in the data's precision
    rows = np.full((n_rows, codes.size), np.nan)
    redo = np.empty(table.size // 4, np.int64)
    count = 0
    for k in range(table.size // 4):
        row, address, size, scalar = table[4 * k], table[4 * k + 1], table[4 * k + 2], table[4 * k + 3]
        if not statistics_at(address, size, eps, small_size, codes, rows[row], scalar != 0):
            redo[count] = k
            count += 1
    return rows, redo[:count]


float32_at = _jit(float32_at_loop)


def _rows_statistics_at(address, rows, row_length, row_stride, eps, small_size, codes, row):
    """`_statistics_at` of a strided tensor whose elements lie in `rows` runs of `row_length` values,
    `row_stride` values apart from one start to the next (a slice of a wider tensor's last dimension): each
    run read where it lies, their sums added in float64, their extremes combined."""
    total = squares = 0.0
    small = 0
    minimum, maximum = np.inf, -np.inf
    for r in range(rows):
        start = address + 4 * r * row_stride
        values = numba.carray(_FLOAT32(start), row_length)
        signed, unsigned = numba.carray(_INT32(start), row_length), numba.carray(_UINT32(start), row_length)
        if rows * row_length <= small_size:
            found = array_loop(values, signed, unsigned, eps, 0.0)
        else:
            found = array_loop(values, signed, unsigned, eps, np.float32(0))
        total += found[0]
        squares += found[1]
        small += found[2]
        minimum = min(minimum, found[3])
        maximum = max(maximum, found[4])
    return statistics_row((total, squares, small, minimum, maximum), rows * row_length, codes, row, False)


def _python_rows_statistics_at(address, rows, row_length, row_stride, eps, small_size, codes, row):
    """`_rows_statistics_at` as plain Python (NUMBA_DISABLE_JIT=1)."""
    values = np.lib.stride_tricks.as_strided(_python_float32s(address, (rows - 1) * row_stride + row_length),
                                             (rows, row_length), (4 * row_stride, 4)).reshape(-1)
    zero = np.float64(0) if values.size <= small_size else np.float32(0)
    return statistics_row_loop(one_pass_loop(values, values.view(np.int32), values.view(np.uint32), eps, zero),
                               values.size, codes, row, False)


rows_statistics_at = _python_rows_statistics_at if numba.config.DISABLE_JIT else _jit(_rows_statistics_at)


def rows_at_loop(table, eps, small_size, codes, n_rows):
    """`one_pass.row_reductions_at`: the rows of a table of (row, address, rows, row length, row stride); the
    table positions of the tensors holding NaN or inf."""
    eps = np.float32(eps)
    rows = np.full((n_rows, codes.size), np.nan)
    redo = np.empty(table.size // 5, np.int64)
    count = 0
    for k in range(table.size // 5):
        row, address, runs, length, stride = table[5 * k], table[5 * k + 1], table[5 * k + 2], table[5 * k + 3], \
            table[5 * k + 4]
        if not rows_statistics_at(address, runs, length, stride, eps, small_size, codes, rows[row]):
            redo[count] = k
            count += 1
    return rows, redo[:count]


rows_at = _jit(rows_at_loop)


_copy_or_add_loop = _jit(copy_or_add, fastmath=True)


def _add_at(target, source, size, first):
    """`total += micro` (`first`: `total[:] = micro`), `size` float32 values at each of the two addresses."""
    _copy_or_add_loop(numba.carray(_FLOAT32(target), size), numba.carray(_FLOAT32(source), size), first)


def _python_add_at(target, source, size, first):
    """`_add_at` as plain Python (NUMBA_DISABLE_JIT=1)."""
    copy_or_add(_python_float32s(target, size), _python_float32s(source, size), first)


def _python_float32s(address, size):
    return np.frombuffer((ctypes.c_char * (int(size) * 4)).from_address(int(address)), np.float32)


add_at = _python_add_at if numba.config.DISABLE_JIT else _jit(_add_at)


def adds_at_loop(table, eps, small_size, codes, n_rows):
    """`one_pass.adds_at`: the adds of a table of (sum's address, gradient's address, size, first, row), a
    row >= 0 taking the statistics of the sum just made (while it is in cache); the rows holding NaN or inf."""
    eps = np.float32(eps)
    rows = np.full((n_rows, codes.size), np.nan)
    redo = np.empty(table.size // 5, np.int64)
    count = 0
    for k in range(table.size // 5):
        target, source, size, first, row = (table[5 * k], table[5 * k + 1], table[5 * k + 2], table[5 * k + 3],
                                            table[5 * k + 4])
        add_at(target, source, size, first != 0)
        if row >= 0 and not statistics_at(target, size, eps, small_size, codes, rows[row], False):
            redo[count] = row
            count += 1
    return rows, redo[:count]


adds_at = _jit(adds_at_loop)


# Decimal text: what `repr(round(value, ndigits))` prints, made from the exact binary value. Bytes it writes.
_MINUS, _POINT, _COMMA, _NEWLINE, _UNWRITTEN = 45, 46, 44, 10, 63   # '-', '.', ',', '\n', '?'
_LOW32, _U32, _U1 = np.uint64(0xFFFFFFFF), np.uint64(32), np.uint64(1)


def wide_product(a, b):
    """a * b of two uint64 as (high, low) uint64 words, from 32-bit halves."""
    a0, a1, b0, b1 = a & _LOW32, a >> _U32, b & _LOW32, b >> _U32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    middle = (p00 >> _U32) + (p01 & _LOW32) + (p10 & _LOW32)
    return p11 + (p01 >> _U32) + (p10 >> _U32) + (middle >> _U32), (p00 & _LOW32) | (middle << _U32)


def scaled_to_integer(magnitude, scale):
    """`magnitude * scale` rounded to the nearest integer, ties to even, computed from the exact binary value
    (as CPython's `round` and `%f` do); for magnitude * scale < 2 ** 62 and magnitude < 2 ** 52."""
    fraction, exponent = math.frexp(magnitude)
    mantissa = np.uint64(fraction * 9007199254740992.0)   # * 2 ** 53: exact
    shift = 53 - exponent                                # magnitude = mantissa / 2 ** shift, shift > 0
    if shift >= 118:                                     # the product is below 2 ** 117 = half of 2 ** 118
        return 0
    high, low = wide_product(mantissa, np.uint64(scale))
    if shift < 64:
        kept = (low >> np.uint64(shift)) | ((high << np.uint64(63 - shift)) << _U1)
        rest_high, rest_low = np.uint64(0), low & ((_U1 << np.uint64(shift)) - _U1)
        half_high, half_low = np.uint64(0), _U1 << np.uint64(shift - 1)
    else:
        kept = high >> np.uint64(shift - 64)
        rest_high, rest_low = high & ((_U1 << np.uint64(shift - 64)) - _U1), low
        half_high = (_U1 << np.uint64(shift - 65)) if shift > 64 else np.uint64(0)
        half_low = np.uint64(0) if shift > 64 else _U1 << np.uint64(63)
    above = rest_high > half_high or (rest_high == half_high and rest_low > half_low)
    tie = rest_high == half_high and rest_low == half_low
    if above or (tie and kept & _U1):
        kept += _U1
    return np.int64(kept)


def decimal_digits(number):
    """How many decimal digits `number` > 0 has (1 for 0)."""
    digits = 1
    number //= 10
    while number:
        digits += 1
        number //= 10
    return digits


def write_digits(out, at, number, width):
    """`number` >= 0 in decimal into `out` from `at`, zero-padded to `width` digits; returns the end."""
    digits = max(decimal_digits(number), width)
    for k in range(digits):
        out[at + digits - 1 - k] = 48 + number % 10
        number //= 10
    return at + digits


def write_text(out, at, text):
    for k in range(len(text)):
        out[at + k] = ord(text[k])
    return at + len(text)


def write_rounded(out, at, value, ndigits, scale, positional, limit):
    """`repr(round(value, ndigits))` into `out` from `at` for |value| < `limit` (10 ** (15 - ndigits)), NaN
    and inf; '?' for any other (the caller writes those). `scale` is 10 ** ndigits, `positional` the
    rounded multiple from which repr prints positionally (1e-4 * scale). Returns the end."""
    if value != value:
        return write_text(out, at, "nan")
    magnitude = abs(value)
    if limit <= magnitude < np.inf:
        out[at] = _UNWRITTEN
        return at + 1
    if math.copysign(1.0, value) < 0:
        out[at] = _MINUS
        at += 1
    if magnitude == np.inf:
        return write_text(out, at, "inf")
    number = scaled_to_integer(magnitude, scale)
    if number == 0:
        return write_text(out, at, "0.0")
    if number >= positional:          # >= 1e-4: repr prints it positionally, zeros after the point dropped
        at = write_digits(out, at, number // scale, 1)
        out[at] = _POINT
        fraction, width = number % scale, ndigits
        while width > 1 and fraction % 10 == 0:
            fraction //= 10
            width -= 1
        return write_digits(out, at + 1, fraction, width)
    exponent = -ndigits                  # below 1e-4: d[.ddd]e-XX, the digits without their trailing zeros
    while number % 10 == 0:
        number //= 10
        exponent += 1
    digits = decimal_digits(number)
    exponent += digits - 1
    leading = number // 10 ** (digits - 1)
    out[at] = 48 + leading
    at += 1
    if digits > 1:
        out[at] = _POINT
        at = write_digits(out, at + 1, number - leading * 10 ** (digits - 1), digits - 1)
    at = write_text(out, at, "e-")
    return write_digits(out, at, -exponent, 2)


def rounded_texts_loop(values, columns, ndigits):
    """`write_rounded` of every value, `columns` to a line: values joined by ',', lines by '\\n'. Returns the
    bytes buffer and its length used. 1 <= ndigits <= 15."""
    scale = np.int64(10) ** ndigits
    positional, limit = scale // 10 ** 4, 10.0 ** (15 - ndigits)
    out = np.empty(values.size * 32 + 1, np.uint8)   # a value takes at most 1 + 15 + 1 + 15 bytes
    at = 0
    for k in range(values.size):
        if k:
            out[at] = _NEWLINE if k % columns == 0 else _COMMA
            at += 1
        at = write_rounded(out, at, values[k], ndigits, scale, positional, limit)
    return out, at


# Each compiled where it is defined, so that the functions calling it take the compiled one.
wide_product, scaled_to_integer, decimal_digits, write_digits, write_text, write_rounded = (
    _jit(function) for function in (wide_product, scaled_to_integer, decimal_digits, write_digits, write_text,
                                    write_rounded))
rounded_texts = _jit(rounded_texts_loop)
