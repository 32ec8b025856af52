"""A large table of tensors for the compiled loops, split at tensor boundaries between the calling thread
and helper threads.

Why: the statistics loop makes six reductions of every element. From memory that is not in cache one core
runs it at about half the speed of one BLAS read (measured on a 2-core Xeon, 10 arrays of 4M float32:
0.43 against 0.23 ns per element), because the core is busy computing while its loads wait; a second
core brings it to 0.30. A hook runs while MindSpore's own kernels wait for it (synchronous execution:
the only case in which tensors are read at their data pointers), so the other cores are idle then.

Each tensor is still reduced whole, by the one compiled function, so its numbers do not depend on how the
table was split. A table under `MIN_ELEMENTS` is not split: handing work to a thread costs tens of
microseconds. The helpers are daemon threads, started on the first large table of a process (again in a
process forked after that) and blocked on a queue between tables; the compiled loops release the GIL.
"""
import os
import queue
import threading
from typing import Callable, List, Sequence, Tuple

import numpy as np

# Elements below which a table is reduced by the calling thread alone.
MIN_ELEMENTS = 1 << 20
# At most this many threads share one table: more adds little on memory that one socket serves.
MAX_PARTS = 4


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # no affinity on this platform
        return os.cpu_count() or 1


class _Helpers:
    """Daemon threads that run compiled calls handed to them; one set per process."""

    def __init__(self, count: int):
        self.pid = os.getpid()
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        for number in range(count):
            threading.Thread(target=self._serve, name=f"mindmon-statistics-{number}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            function, arguments, reply = self.jobs.get()
            try:
                reply.put((True, function(*arguments)))
            except BaseException as error:  # noqa: BLE001 - given back to the caller, who raises it
                reply.put((False, error))

    def start(self, function: Callable, arguments: tuple) -> "queue.SimpleQueue":
        reply: "queue.SimpleQueue" = queue.SimpleQueue()
        self.jobs.put((function, arguments, reply))
        return reply


_helpers = None
_helpers_lock = threading.Lock()


def _helper_threads() -> _Helpers:
    global _helpers
    with _helpers_lock:
        if _helpers is None or _helpers.pid != os.getpid():   # threads do not survive a fork
            _helpers = _Helpers(min(MAX_PARTS, _cores()) - 1)
        return _helpers


def parts(sizes: np.ndarray) -> int:
    """How many threads a table of tensors of `sizes` elements is split between (1: not split)."""
    if sizes.size < 2 or int(sizes.sum()) < MIN_ELEMENTS:
        return 1
    return min(MAX_PARTS, _cores(), int(sizes.size))


def cuts(sizes: np.ndarray, count: int) -> List[int]:
    """Entry positions that split tensors of `sizes` elements into `count` runs of about equal elements,
    none empty: [0, ..., len(sizes)]."""
    cumulative = np.cumsum(sizes)
    targets = cumulative[-1] * np.arange(1, count) / count
    inner = np.searchsorted(cumulative, targets, side="left") + 1
    bounds = [0]
    for position in inner.tolist():
        bounds.append(min(max(position, bounds[-1] + 1), len(sizes) - (count - len(bounds))))
    return bounds + [len(sizes)]


def split_call(function: Callable, table: np.ndarray, width: int, sizes: np.ndarray, row_column: int,
               redo_is_position: bool, arguments: Sequence) -> Tuple[np.ndarray, np.ndarray]:
    """`function(table, *arguments)` for a compiled table call that returns (rows, redo), `table` holding
    `width` int64 columns per tensor, `sizes` their element counts; the tensors' rows are named in column
    `row_column` (-1: none). `redo_is_position`: redo holds table positions (else rows). Large tables are
    split (`parts`), the pieces' rows and redo merged as one call would return them."""
    count = parts(sizes)
    if count == 1:
        return function(table, *arguments)
    bounds = cuts(sizes, count)
    pieces = [table[width * start:width * end] for start, end in zip(bounds[:-1], bounds[1:])]
    helpers = _helper_threads()
    replies = [helpers.start(function, (piece, *arguments)) for piece in pieces[1:]]
    try:
        rows, redo = function(pieces[0], *arguments)
    finally:   # every helper done before anyone may free the memory the table points at
        results = [reply.get() for reply in replies]
    redos = [redo]
    for start, piece, (done, result) in zip(bounds[1:], pieces[1:], results):
        if not done:
            raise result
        piece_rows, piece_redo = result
        named = piece[row_column::width]
        named = named[named >= 0]
        rows[named] = piece_rows[named]
        redos.append(piece_redo + start if redo_is_position else piece_redo)
    return rows, np.concatenate(redos)
