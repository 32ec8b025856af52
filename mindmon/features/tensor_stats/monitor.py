"""Per-tensor statistics (msprobe's `ops`) for many tensors at one collection point, no host sync per tensor.

The statistics, all of the tensor flattened:
    min, max   smallest / largest element; NaN if the tensor holds a NaN
    mean       signed mean; NaN with a NaN inside, +-inf / NaN with infinities, as arithmetic gives
    norm       L2 norm
    zeros      share of elements with |x| < eps
    nans       number of NaN elements
    id         the value of a 0-dim tensor; NaN for any other

On CPU they are taken right away, in one compiled pass over the tensor's memory (`mindmon/kernels/one_pass.py`;
with synchronous execution from the data pointer, else through `asnumpy()`, a view). A float32 tensor
of more than 4096 elements is summed in float32 blocks added in float64 (relative error about 1e-7, the
precision of the data), anything smaller in float64.
Elsewhere the tensors of a collection point are reduced on the device together, in a number of
MindSpore operations that does not grow with the number of tensors (`mindmon/kernels/device.py`), and
the host reads everything once, at `collect`.

A collection point (`param_origin`, `grad_reduced`, ...) becomes one `TensorStatsRecord` per tensor:
kind = the point's name (the CSV file prefix), name = the tensor's name, value = the statistics in
`ops` order, plus `ops`, `shape` and `dtype`.

Example:
    monitor = TensorStatsMonitor(("min", "max", "norm"), eps=1e-8, on_host=True)
    monitor.record("grad_reduced", [("fc1.weight", grad)])
    records = monitor.collect(step=1)   # [TensorStatsRecord(kind="grad_reduced", name="fc1.weight", ...)]
"""
import math
from itertools import count
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from mindmon.compat import dtype_name, is_float32
from mindmon.core.engine import Monitor
from mindmon.features.tensor_stats.points import (ACTV, ACTV_GRAD, POINTS)
from mindmon.core.records import Record, TensorStatsRecord
from mindmon.kernels.device import EMPTY_STATISTICS, DeviceRows, device_statistics, read_all
from mindmon.kernels.one_pass import ROW_STATISTICS, prepare, reductions, reductions_at, row_reductions_at
from mindmon.kernels.stats import (SMALL, StepDirectViews, direct_view, element_count, float32_memories,
                                   float32_runs, host_array)




def numpy_stats(flat: np.ndarray, ops: Sequence[str], eps: float, scalar: bool = False) -> List[float]:
    """The statistics of one flat array (of a 0-dim tensor when `scalar`), in `ops` order: one compiled
    pass (float32 as `_float32_row` says, the rest by `one_pass.reductions`, and float32 holding NaN or inf
    too); data that is not float32/float64 is taken as float64 first."""
    size = flat.size
    if not size:
        return [EMPTY_STATISTICS[op] for op in ops]
    if flat.dtype == np.float32:
        row = _float32_row(flat, ops, eps, scalar)
        if row is not None:
            return row
    elif flat.dtype != np.float64:
        flat = flat.astype(np.float64)
    found = reductions(flat, eps, wide=size <= SMALL)
    total = found.total
    if not math.isfinite(total):   # NaN or +-inf inside, or a float32 block overflowed
        with np.errstate(invalid="ignore"):   # inf + -inf is NaN, as it should be: no warning
            total = float(np.add.reduce(flat, dtype=np.float64))
    # A NaN makes the sum NaN, so a finite sum proves there is none without another pass.
    nans = 0 if math.isfinite(total) else int(np.count_nonzero(np.isnan(flat)))
    values = {"min": math.nan if nans else found.minimum, "max": math.nan if nans else found.maximum,
              "mean": total / size, "norm": _root(found.squares, flat), "zeros": found.small / size,
              "nans": float(nans), "id": float(flat[0]) if scalar else math.nan}
    return [values[op] for op in ops]


def _float32_row(flat: np.ndarray, ops: Sequence[str], eps: float, scalar: bool) -> Optional[List[float]]:
    """A float32 array's statistics by the compiled code that reads tensors at their data pointers
    (`reductions_at`), so that a tensor gets the same numbers whichever way it reached the statistics:
    two compiled copies of the loop may add in different orders (its sums are reassociated into vector
    lanes, and numba's code loaded from its disk cache was seen to differ from code just compiled in the
    last float32 bit). None when the array holds NaN or inf (numpy's rules then)."""
    flat = np.ascontiguousarray(flat)
    table = np.array([0, flat.ctypes.data, flat.size, scalar], dtype=np.int64)
    rows, redo = reductions_at(table, eps, SMALL, statistic_codes(ops), 1)
    return None if redo.size else rows[0].tolist()


def _root(squared: float, flat: np.ndarray) -> float:
    """sqrt of a sum of squares; float32 squares that overflowed are summed again in float64 (inf/NaN data
    stay what they are)."""
    if not math.isfinite(squared) and flat.dtype != np.float64:
        flat64 = flat.astype(np.float64)
        squared = float(np.dot(flat64, flat64))
    return math.sqrt(squared) if not math.isnan(squared) else float("nan")


def host_statistics(tensors: Sequence, ops: Sequence[str], eps: float, direct: bool
                    ) -> Tuple[np.ndarray, List[tuple]]:
    """The statistics of tensors on the host, float64 [tensors, ops], and each tensor's (shape, dtype) as it
    gives them (`layout` turns them into msprobe's text at the step end: in a hook's context every call
    costs several times its warm time). With `direct` (see `direct_views_allowed`), float32 tensors are read
    where they lie: their data pointers go to the compiled code in one call, which writes their rows (0-dim
    ones too: a MoE layer's auxiliary loss); no array is made (per tensor, that cost more than the loop over
    a small one). The rest, and tensors holding NaN or inf, go through `numpy_stats` one by one. A tensor
    given more than once is read once (a cell's output that is the next cells' input, one gradient with
    several cells' rows), and so is memory two tensors share (`_first_of_each`). Each tensor's shape, dtype
    and data pointer are read by `float32_memories`, with no Python frame per tensor."""
    shapes, dtypes, addresses = float32_memories(tensors, direct)
    layouts = list(zip(shapes, dtypes))
    size_list = list(map(math.prod, shapes))
    firsts = _first_of_each(tensors, shapes, size_list, addresses)
    repeated = firsts != np.arange(len(tensors))
    sizes = np.array(size_list, dtype=np.int64)
    address_array = np.array(addresses, dtype=np.int64)
    located = (address_array != 0) & (sizes != 0) & ~repeated
    rows_located = np.flatnonzero(located)
    if rows_located.size:
        table = np.empty((rows_located.size, 4), dtype=np.int64)   # row, address, size, 0-dim
        table[:, 0], table[:, 1], table[:, 2] = rows_located, address_array[rows_located], sizes[rows_located]
        table[:, 3] = np.array(list(map(len, shapes)), dtype=np.int64)[rows_located] == 0
        rows, redo = reductions_at(table.reshape(-1), eps, SMALL, statistic_codes(ops), len(tensors))
        for index in table[redo, 0].tolist():   # NaN or inf: numpy's rules
            rows[index] = numpy_stats(direct_view(tensors[index], "Float32"), ops, eps, not shapes[index])
    else:
        rows = np.empty((len(tensors), len(ops)))
    elsewhere = np.flatnonzero(~located & ~repeated).tolist()
    if direct and elsewhere:
        elsewhere = _strided_statistics(tensors, layouts, elsewhere, ops, eps, rows)
    for index in elsewhere:
        shape, dtype = layouts[index]
        rows[index] = numpy_stats(host_array(tensors[index], direct, dtype_name(dtype)), ops, eps, not shape)
    rows[repeated] = rows[firsts[repeated]]
    return rows, layouts


def _first_of_each(tensors: Sequence, shapes: List, sizes: List[int], addresses: List[int]) -> np.ndarray:
    """For each tensor, the index of the first one with the same elements: the same tensor (`id`), or a
    float32 one at the same data pointer with as many elements, both 0-dim or neither (a 0-dim tensor's `id`
    statistic is its value). Every tensor is alive in `tensors` during the call, so an id or a data pointer
    names one object or one piece of memory. Shared memory is common: a cell's input is often the output of
    the cell before it, passed through a `HookBackward` marker, which gives a new tensor on the same memory
    (in the benchmark's step 2,828 rows hold 2,348 tensors but 1,634 pieces of memory: a quarter fewer
    elements to read than by `id`)."""
    keys = list(zip(addresses, sizes, map(bool, shapes)))
    for index in [i for i, address in enumerate(addresses) if not address]:
        keys[index] = (0, id(tensors[index]), None)
    first_seen: Dict[tuple, int] = {}
    return np.fromiter(map(first_seen.setdefault, keys, count()), np.int64, len(tensors))


def _strided_statistics(tensors: Sequence, layouts: List[tuple], indices: List[int], ops: Sequence[str],
                        eps: float, rows: np.ndarray) -> List[int]:
    """Into `rows`: the statistics of the strided float32 tensors among `indices` whose elements lie in equal
    runs (`float32_runs`), read where they lie, in one compiled call; returns the indices left (other
    dtypes and layouts, NaN or inf) for `numpy_stats`."""
    strided, left = [], []
    for index in indices:
        runs = float32_runs(tensors[index]) if is_float32(layouts[index][1]) else None
        if runs is None:
            left.append(index)
        else:
            strided += (index, *runs)
    if strided:
        found, redo = row_reductions_at(np.array(strided, dtype=np.int64), eps, SMALL, statistic_codes(ops),
                                        len(tensors))
        taken = [strided[5 * k] for k in range(len(strided) // 5)]
        rows[taken] = found[taken]
        left += [strided[5 * k] for k in redo.tolist()]
    return left


_CODES: Dict[Tuple[str, ...], np.ndarray] = {}


def statistic_codes(ops: Sequence[str]) -> np.ndarray:
    """`ops` as `reductions_at` and `adds_at` take them (remembered per ops tuple)."""
    codes = _CODES.get(tuple(ops))
    if codes is None:
        codes = _CODES[tuple(ops)] = np.array([ROW_STATISTICS.index(op) for op in ops], dtype=np.int64)
    return codes


class HostTensor:
    """An array already in host memory, standing for a tensor of MindSpore dtype `dtype` (e.g. a sum of
    gradients kept in float64 numpy)."""

    def __init__(self, array: np.ndarray, dtype: str):
        self.array = array
        self.dtype = dtype
        self.shape = array.shape

    def asnumpy(self) -> np.ndarray:
        return self.array


def layout(shape, dtype) -> Tuple[Tuple[int, ...], str]:
    """A tensor's shape and dtype objects as msprobe prints them: `(16, 8)`, `Float32`."""
    return tuple(map(int, shape)), dtype_name(dtype)


def layouts(raw: Sequence[tuple]) -> List[Tuple[Tuple[int, ...], str]]:
    """`layout` of each (shape, dtype), by `map`s over all of them: a step's hundreds of tensors share a few
    dozen shapes (remembered) and mostly one dtype object (named once)."""
    if not raw:
        return []
    shapes, dtypes = zip(*raw)
    names = [dtype_name(dtypes[0])] * len(dtypes) if dtypes.count(dtypes[0]) == len(dtypes) else \
        list(map(dtype_name, dtypes))
    try:
        known = list(map(_SHAPES.get, shapes))
    except TypeError:   # a shape that is not a tuple
        known = [None]
    if None in known:
        known = [tuple(map(int, shape)) for shape in shapes]
        if len(_SHAPES) < _SHAPES_KEPT:
            _SHAPES.update(zip(map(tuple, shapes), known))
    return list(zip(known, names))


_SHAPES: Dict[tuple, Tuple[int, ...]] = {}   # a shape as a tensor gives it -> as plain ints
_SHAPES_KEPT = 1 << 14


class Gathered(NamedTuple):
    """The statistics of the tensors of one point and micro-step taken with one `ops` (ops may change while
    training), as `TensorStats.results()` gives them: values float64 [tensors, ops], layouts each tensor's
    (shape, dtype) as `layout` gives them."""

    point: str
    micro_step: Optional[int]
    names: List[str]
    layouts: List[tuple]
    values: object
    ops: Tuple[str, ...]


class ComputedStatistics(NamedTuple):
    """Statistics taken already, recorded as they are: values float64 [tensors, ops], layouts each tensor's
    (shape, dtype) (the gradient sums', taken in the pass that made them: mindmon.features.tensor_stats.accumulate)."""

    names: List[str]
    layouts: List[tuple]
    values: np.ndarray
    ops: Tuple[str, ...]


class _Batch:
    """What the adds of one (point, micro-step, ops) gathered, in their order: a step's hook calls extend a
    few of these rather than each leaving objects of its own until the step's end (thousands a step, which
    the cycle collector then walks again and again: full collections every few steps, 0.13 s each here).
    `waiting`: tensors added with `add_later` whose statistics are not taken yet (their names are the last
    of `names`)."""

    __slots__ = ("names", "layouts", "values", "waiting")

    def __init__(self):
        self.names: List[str] = []
        self.layouts: List[tuple] = []
        self.values: List[object] = []   # float64 arrays [tensors, ops], or DeviceRows
        self.waiting: List[object] = []


# Elements of the tensors `add_later` holds before it takes their statistics: 64 MiB of float32, enough
# for one compiled call to split between threads (mindmon.kernels.split), little beside a step's activations.
WAITING_ELEMENTS = 1 << 24


class TensorStats:
    """Statistics of named tensors, gathered per (point, micro_step); read with `results()`. A point may
    also be given as `ComputedStatistics`."""

    def __init__(self, ops: Sequence[str], eps: float, on_host: bool):
        self.ops = tuple(ops)
        self.eps = eps
        self.on_host = on_host
        self._batches: Dict[Tuple[str, Optional[int], Tuple[str, ...]], _Batch] = {}
        self._waiting_elements = 0
        self.direct_views = StepDirectViews()

    def add(self, point: str, named_tensors: Sequence[Tuple[str, object]], micro_step: Optional[int] = None):
        if isinstance(named_tensors, ComputedStatistics):
            computed = named_tensors
            if computed.names:
                self._extend(point, micro_step, computed.ops, computed.names, computed.layouts, computed.values)
            return
        if not named_tensors:
            return
        names = [name for name, _ in named_tensors]
        tensors = [t for _, t in named_tensors]
        values, layouts = self._statistics(tensors)
        self._extend(point, micro_step, self.ops, names, layouts, values)

    def add_later(self, point: str, named_tensors: Sequence[Tuple[str, object]], micro_step: Optional[int] = None):
        """`add`, for tensors nothing changes in place before `results()` (a step's activations and their
        gradients, not the parameters an optimizer updates): on the host they are held and their statistics
        taken together, when they reach `WAITING_ELEMENTS` or at `results()`. A hook call then costs no
        compiled call of its own and reads nothing of a tensor but its size: the shapes, dtypes and data
        pointers of everything held are read together at the take, by `map`s (costing about what reading
        them tensor by tensor in the hooks did), and one call over many tensors is split between threads."""
        if not self.on_host:
            return self.add(point, named_tensors, micro_step)
        if not named_tensors:
            return
        batch = self._batch(point, micro_step, self.ops)
        names, tensors = zip(*named_tensors)
        batch.names += names
        batch.waiting += tensors
        self._waiting_elements += element_count(tensors)
        if self._waiting_elements >= WAITING_ELEMENTS:
            self._take_waiting()

    def _statistics(self, tensors: List[object]) -> Tuple[object, List[tuple]]:
        """(values, layouts) of tensors, as `_Batch` keeps them."""
        if self.on_host:
            return host_statistics(tensors, self.ops, self.eps, self.direct_views.allowed())
        return device_statistics(tensors, self.ops, self.eps), [(t.shape, t.dtype) for t in tensors]

    def _take_waiting(self) -> None:
        """The statistics of every batch's waiting tensors, in one compiled call; the tensors let go."""
        batches = [(key, batch) for key, batch in self._batches.items() if batch.waiting]
        self._waiting_elements = 0
        if not batches:
            return
        direct = self.direct_views.allowed()
        ops_sets = {key[2] for key, _ in batches}
        if len(ops_sets) > 1:   # ops changed while tensors waited: one call per ops
            for key, batch in batches:
                self._take(batch, *host_statistics(batch.waiting, key[2], self.eps, direct))
            return
        tensors = [tensor for _, batch in batches for tensor in batch.waiting]
        values, layouts = host_statistics(tensors, ops_sets.pop(), self.eps, direct)
        start = 0
        for _, batch in batches:
            end = start + len(batch.waiting)
            self._take(batch, values[start:end], layouts[start:end])
            start = end

    @staticmethod
    def _take(batch: "_Batch", values: np.ndarray, layouts: List[tuple]) -> None:
        batch.layouts += layouts
        batch.values.append(values)
        batch.waiting.clear()

    def _batch(self, point: str, micro_step: Optional[int], ops: Tuple[str, ...]) -> _Batch:
        batch = self._batches.get((point, micro_step, ops))
        if batch is None:
            batch = self._batches[(point, micro_step, ops)] = _Batch()
        return batch

    def _extend(self, point: str, micro_step: Optional[int], ops: Tuple[str, ...], names, layouts, values):
        batch = self._batch(point, micro_step, ops)
        if batch.waiting:   # rows stay in the order they were added
            self._take_waiting()
        batch.names += names
        batch.layouts += layouts
        batch.values.append(values)

    def results(self) -> List[Gathered]:
        """Everything gathered, per (point, micro_step, ops) in the order first seen: statistics as float64
        arrays [tensors, ops], layouts as `layout` gives them; one host transfer at most."""
        self._take_waiting()
        host = iter(read_all([v for batch in self._batches.values() for v in batch.values
                              if isinstance(v, DeviceRows)]))
        gathered = []
        for (point, micro_step, ops), batch in self._batches.items():
            values = [next(host) if isinstance(v, DeviceRows) else v for v in batch.values]
            gathered.append(Gathered(point, micro_step, batch.names, layouts(batch.layouts),
                                     values[0] if len(values) == 1 else np.concatenate(values), ops))
        return gathered

    def clear(self) -> None:
        self._batches.clear()
        self._waiting_elements = 0
        self.direct_views.forget()


# Points whose tensors nothing changes in place before the step's statistics are collected: a cell's
# forward values and their gradients (MindSpore makes new tensors for both), not the parameters, gradients
# and moments the optimizer updates.
_UNCHANGED_TO_STEP_END = (ACTV, ACTV_GRAD)


class TensorStatsMonitor(Monitor):
    """The engine's view of `TensorStats`: `record(point, named_tensors, {"micro_step": k})` for each
    point in `POINTS`, `collect(step)` returns one TensorStatsRecord per tensor and point."""

    KEYS = POINTS

    def __init__(self, ops: Sequence[str], eps: float = 1e-8, on_host: Optional[bool] = None, rank: int = 0):
        if on_host is None:
            from mindmon.kernels.stats import host_is_device

            on_host = host_is_device()
        self.rank = rank
        self.stats = TensorStats(ops, eps, on_host)
        if on_host:
            prepare()   # before training, not in the first collected step

    @property
    def ops(self) -> Tuple[str, ...]:
        return self.stats.ops

    @ops.setter
    def ops(self, ops: Sequence[str]) -> None:
        """Takes effect for what is recorded from now on (msprobe lets users change `ops` while training)."""
        self.stats.ops = tuple(ops)

    def reset(self) -> None:
        self.stats.clear()

    def record(self, key: str, value=None, context: Optional[Dict] = None) -> None:
        add = self.stats.add_later if key in _UNCHANGED_TO_STEP_END else self.stats.add
        add(key, value, (context or {}).get("micro_step"))

    def collect(self, step: int) -> List[Record]:
        records = []
        for entry in self.stats.results():
            records += TensorStatsRecord.for_tensors(step, entry.micro_step, self.rank, entry.point, entry.names,
                                                     entry.values.tolist(), entry.ops, entry.layouts)
        self.reset()
        return records

    def close(self) -> None:
        self.reset()
