"""Many numbers as the text `repr(round(value, ndigits))` gives, written by compiled code.

msprobe's CSV rows hold each statistic rounded to `ndigits` decimal places as Python prints it. A step of
thousands of rows has tens of thousands of numbers; through `round` and `repr` one by one they cost more
than the statistics. The compiled writer (`mindmon.kernels.compiled.rounded_texts`) takes the exact binary
value of each number: its correctly rounded multiple of 10 ** -ndigits (ties to even, as CPython's `round`
and `%f` take it), printed as `repr` prints that multiple's nearest double: positionally with the zeros
after the point dropped from 1e-4 up, `d.ddde-XX` below. Why that is what `repr` prints: the multiple has
at most 15 significant digits (values below 10 ** (15 - ndigits)), and two decimals of at most 15 digits
never round to the same double, so no shorter digit string stands for that double. Larger values are
printed by Python.

Example:
    rounded_lines(np.array([[0.5, 1e-07], [2.0, float("nan")]]), 6)   # ['0.5,0.0', '2.0,nan']
"""
from typing import List, Optional

import numpy as np


def rounded_lines(values: np.ndarray, ndigits: int) -> Optional[List[str]]:
    """Each row of `values` (float64 [rows, columns]) as the `repr(round(value, ndigits))` of its values
    joined by commas; None for `ndigits` outside 1..15 (the caller prints those)."""
    if not 1 <= ndigits <= 15:
        return None
    if not values.size:
        return [""] * values.shape[0]
    from mindmon.kernels.compiled import rounded_texts

    flat = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    out, end = rounded_texts(flat, values.shape[1], ndigits)
    text = out[:end].tobytes().decode("ascii")
    with np.errstate(invalid="ignore"):
        large = flat[np.abs(flat) >= 10.0 ** (15 - ndigits)]
    large = large[np.isfinite(large)]
    if large.size:   # written as '?': Python's text of each, in order
        pieces = text.split("?")
        texts = [repr(round(value, ndigits)) for value in large.tolist()] + [""]
        text = "".join(piece + filled for piece, filled in zip(pieces, texts))
    return text.split("\n")
