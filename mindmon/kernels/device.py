"""Statistics of many tensors reduced on the device in a number of MindSpore operations that does not grow
with the number of tensors.

Off the CPU a statistic is a MindSpore operation dispatched from Python, and the host's dispatch rate
bounds the step: one operation per tensor per statistic is tens of thousands a step for a model of a few
hundred tensors. Here the tensors of one call are flattened (views), concatenated once per dtype (cast to
float32 once), and reduced by segment reductions: `unsorted_segment_sum` of the columns the statistics
need (the values, their squares, NaN flags, small-magnitude flags) and `unsorted_segment_min/max`. What
is left is finished on the host from a few numbers per tensor, after the one transfer of the step
(`read_all`): mean = sum / size, norm = sqrt(sum of squares), min/max NaN when the tensor holds a NaN,
empty tensors as the host path gives them.

The sums are taken in `LEVELS` levels: MindSpore's segment sum adds a segment's elements one after another
in float32, whose rounding grows with the segment (about 1e-3 relative for two million elements, measured
on MindSpore 2.9 CPU); groups of at most `group_size` elements of one tensor are summed first, then groups
of those sums, then each tensor's, keeping float32 precision. Segment ids depend only on the tensors'
sizes: they are built on the host once per set of sizes and kept (a host-to-device copy, no operation
dispatched).

Operations per call and dtype group (each one kernel launch): a concatenation (not for a single tensor),
a cast (not for float32), then per `ops`: square for `norm`; isnan + cast for `nans`, `min`, `max`; abs +
less + cast for `zeros`; a stack of the columns when more than one; `LEVELS` segment sums; one segment
min and one segment max when asked. Reshaping a contiguous tensor into its flat view launches no kernel
(a strided one is copied: one kernel each).
"""
import math
from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

import numpy as np

# An empty tensor: no element to take a min, max or mean of; nothing is zero, NaN or large.
EMPTY_STATISTICS = {"min": math.nan, "max": math.nan, "mean": math.nan, "zeros": math.nan, "norm": 0.0,
                    "nans": 0.0, "id": math.nan}

# Levels of the sums: elements -> blocks -> blocks of blocks -> tensors.
LEVELS = 3
# Fewest members of a group at one level (the group grows with the largest tensor, so that every level
# adds at most about a thousand numbers one after another for tensors of up to a billion elements).
MIN_GROUP = 16


def group_size(largest: int) -> int:
    """Members per group at each level: at least `MIN_GROUP`, about the cube root of the largest tensor,
    a power of two."""
    root = round(max(largest, 1) ** (1 / LEVELS)) + 1
    return max(MIN_GROUP, 1 << (root - 1).bit_length())


class SegmentIds:
    """The segment ids of one set of tensor sizes, on the device: per level of the sum, each member's
    group and the number of groups (`levels`); each element's tensor for min and max (`element_tensors`)."""

    def __init__(self, sizes: Tuple[int, ...], with_elements: bool):
        from mindspore import Tensor

        counts = np.array(sizes, dtype=np.int64)
        self.group = group_size(int(counts.max()))
        self.levels = []
        members = counts
        for _ in range(LEVELS - 1):
            groups = -(-members // self.group)
            starts = np.repeat(np.cumsum(members) - members, members)
            group_starts = np.repeat(np.cumsum(groups) - groups, members)
            ids = group_starts + (np.arange(int(members.sum())) - starts) // self.group
            self.levels.append((Tensor(ids.astype(np.int32)), int(groups.sum())))
            members = groups
        self.levels.append((Tensor(np.repeat(np.arange(len(sizes), dtype=np.int32), members)), len(sizes)))
        self.element_tensors = (Tensor(np.repeat(np.arange(len(sizes), dtype=np.int32), counts))
                                if with_elements else None)


# Segment ids kept per (sizes, min/max wanted): a step's points share a few sets of sizes (the parameters'
# for weights, gradients and moments); activations' sizes vary with the batch.
_IDS: "OrderedDict[Tuple[Tuple[int, ...], bool], SegmentIds]" = OrderedDict()
_IDS_KEPT = 16


def segment_ids(sizes: Tuple[int, ...], with_elements: bool) -> SegmentIds:
    key = (sizes, with_elements)
    ids = _IDS.get(key)
    if ids is None:
        ids = _IDS[key] = SegmentIds(sizes, with_elements)
        if len(_IDS) > _IDS_KEPT:
            _IDS.popitem(last=False)
    else:
        _IDS.move_to_end(key)
    return ids


class DeviceRows:
    """Per-tensor reductions left on the device (`parts`), and how the host turns them, once read, into
    float64 rows [tensors, columns] (`finish`)."""

    def __init__(self, parts: List, finish):
        self.parts = parts
        self.finish = finish


def read_all(results: Sequence[DeviceRows]) -> List[np.ndarray]:
    """Every result's finished rows, its device parts copied to the host in one transfer (one
    concatenation; a result given twice is read once)."""
    unique = list({id(r): r for r in results}.values())
    parts = [part for r in unique for part in r.parts]
    finished: Dict[int, np.ndarray] = {}
    if parts:
        from mindspore import ops

        flat = [part.reshape(-1) for part in parts]
        host = ops.concat(flat).asnumpy().astype(np.float64) if len(flat) > 1 else flat[0].asnumpy().astype(np.float64)
        pieces = iter(np.split(host, np.cumsum([int(p.shape[0]) for p in flat])[:-1]))
        for r in unique:
            finished[id(r)] = r.finish([next(pieces).reshape(tuple(p.shape)) for p in r.parts])
    for r in unique:
        if id(r) not in finished:
            finished[id(r)] = r.finish([])
    return [finished[id(r)] for r in results]


def _dtype_groups(tensors: Sequence) -> List[Tuple[object, List[int]]]:
    """Indices of the non-empty tensors, per dtype, in order of first appearance."""
    groups: Dict[object, List[int]] = {}
    for index, tensor in enumerate(tensors):
        if int(tensor.size):
            groups.setdefault(tensor.dtype, []).append(index)
    return list(groups.items())


def _flat_float32(tensors: Sequence, dtype):
    """One flat float32 tensor of `tensors` (all of `dtype`): a concatenation of their flat views, cast once."""
    import mindspore as ms
    from mindspore import ops

    flats = [t.reshape(-1) for t in tensors]
    flat = flats[0] if len(flats) == 1 else ops.concat(flats)
    return flat if dtype == ms.float32 else flat.astype(ms.float32)


def _segment_sums(columns, ids: SegmentIds):
    """Per-tensor sums of `columns` [elements, k], level by level (see the module's text)."""
    from mindspore import ops

    for level_ids, count in ids.levels:
        columns = ops.unsorted_segment_sum(columns, level_ids, count)
    return columns


# The sums a statistic needs: the values, their squares, NaN flags, |x| < eps flags.
_SUMS_FOR = {"mean": ("values",), "id": ("values",), "norm": ("squares",), "nans": ("nans",),
             "min": ("nans", "values"), "max": ("nans", "values"), "zeros": ("small",)}
_SUMS = ("values", "squares", "nans", "small")


def _wanted(ops: Tuple[str, ...]) -> Tuple[List[str], List[str]]:
    """The per-tensor sums (`_SUMS`) and extremes (min, max) that `ops` need."""
    sums = [name for name in _SUMS if any(name in _SUMS_FOR[op] for op in ops)]
    return sums, [op for op in ("min", "max") if op in ops]


def _reductions(flat, sizes: Tuple[int, ...], sums: List[str], extremes: List[str], eps: float) -> List:
    """The device parts of one flat float32 tensor holding tensors of `sizes` one after another: the
    stacked `sums` per tensor [tensors, len(sums)], then each extreme per tensor."""
    from mindspore import mint
    from mindspore import ops as msops
    import mindspore as ms

    ids = segment_ids(sizes, bool(extremes))
    columns, parts = [], []
    for name in sums:
        if name == "values":
            columns.append(flat)
        elif name == "squares":
            columns.append(mint.square(flat))
        elif name == "nans":
            columns.append(msops.isnan(flat).astype(ms.float32))
        else:
            columns.append((mint.abs(flat) < eps).astype(ms.float32))
    if columns:
        stacked = msops.stack(columns, 1) if len(columns) > 1 else columns[0].reshape(-1, 1)
        parts.append(_segment_sums(stacked, ids))
    for op in extremes:
        reduce = msops.unsorted_segment_min if op == "min" else msops.unsorted_segment_max
        parts.append(reduce(flat, ids.element_tensors, len(sizes)))
    return parts


def _rows_of(ops: Tuple[str, ...], sums: List[str], extremes: List[str], pieces, sizes: Tuple[int, ...],
             scalar: np.ndarray) -> np.ndarray:
    """The finished rows of one `_reductions` call from its parts read to the host (`pieces`, consumed)."""
    found = dict(zip(sums, next(pieces).T)) if sums else {}
    found.update((op, next(pieces)) for op in extremes)
    return _finished_rows(ops, found, np.array(sizes, dtype=np.float64), scalar)


def _empty_rows(ops: Tuple[str, ...], count: int) -> np.ndarray:
    return np.tile(np.array([EMPTY_STATISTICS[op] for op in ops], dtype=np.float64), (count, 1))


def device_statistics(tensors: Sequence, ops: Sequence[str], eps: float) -> DeviceRows:
    """The statistics (`mindmon.features.tensor_stats.monitor`'s `ops`) of each of `tensors`, reduced on the
    device, finished on the host as float64 rows [tensors, ops] by `read_all`."""
    ops = tuple(ops)
    sums, extremes = _wanted(ops)
    parts, groups = [], []
    for dtype, indices in _dtype_groups(tensors):
        sizes = tuple(int(tensors[i].size) for i in indices)
        parts += _reductions(_flat_float32([tensors[i] for i in indices], dtype), sizes, sums, extremes, eps)
        groups.append((indices, sizes))
    scalars = np.array([not tuple(t.shape) for t in tensors], dtype=bool)

    def finish(host: List[np.ndarray]) -> np.ndarray:
        rows = _empty_rows(ops, len(tensors))
        pieces = iter(host)
        for indices, sizes in groups:
            rows[indices] = _rows_of(ops, sums, extremes, pieces, sizes, scalars[indices])
        return rows

    return DeviceRows(parts, finish)


def _finished_rows(ops: Tuple[str, ...], found: Dict[str, np.ndarray], size: np.ndarray,
                   scalar: np.ndarray) -> np.ndarray:
    """Rows [tensors, ops] of one dtype group from its per-tensor sums and extremes (`found`), with numpy's
    rules: min and max NaN when a NaN is inside; `id` a 0-dim tensor's value (its sum), NaN for any other."""
    poisoned = found["nans"] > 0 if "nans" in found else False
    with np.errstate(invalid="ignore", divide="ignore"):
        values = {"mean": lambda: found["values"] / size, "norm": lambda: np.sqrt(found["squares"]),
                  "zeros": lambda: found["small"] / size, "nans": lambda: found["nans"],
                  "min": lambda: np.where(poisoned, np.nan, _infinite_extreme(found["min"], found["values"])),
                  "max": lambda: np.where(poisoned, np.nan, _infinite_extreme(found["max"], found["values"])),
                  "id": lambda: np.where(scalar, found["values"], np.nan)}
        return np.stack([values[op]() for op in ops], axis=1)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _infinite_extreme(extreme: np.ndarray, total: np.ndarray) -> np.ndarray:
    """MindSpore's segment max starts from float32's lowest number, its min from the largest: a tensor whose
    elements are all -inf gets max -3.4e38 (all +inf: min 3.4e38). Its sum says which: -inf (+inf). (A
    tensor of only -inf and exactly -3.4e38 would be told -inf too.)"""
    return np.where((np.abs(extreme) == _FLOAT32_MAX) & (total == np.sign(extreme) * np.inf),
                    np.sign(extreme) * np.inf, extreme)


def device_squared_norms(tensors: Sequence) -> DeviceRows:
    """The squared L2 norm of each of `tensors`, reduced on the device; `read_all` gives float64 [tensors]."""
    from mindspore import mint

    parts, groups = [], []
    for dtype, indices in _dtype_groups(tensors):
        flat = _flat_float32([tensors[i] for i in indices], dtype)
        ids = segment_ids(tuple(int(tensors[i].size) for i in indices), False)
        parts.append(_segment_sums(mint.square(flat), ids))
        groups.append(indices)

    def finish(host: List[np.ndarray]) -> np.ndarray:
        squared = np.zeros(len(tensors), dtype=np.float64)
        for indices, part in zip(groups, host):
            squared[indices] = part.reshape(-1)
        return squared

    return DeviceRows(parts, finish)


class FlatSums:
    """Per-key sums of tensors (a step's micro-batch gradients per parameter) in one flat float32 tensor on
    the device, and their statistics read from it, in a number of kernels that does not grow with the
    number of keys. `add(keyed)` adds one tensor per key (a micro-batch): per dtype their flat views
    concatenated and cast to float32 once, the groups concatenated, then one add into the flat sum (the
    first micro-batch's concatenation is the sum). The sum's segments are grouped by dtype in the order the
    keys first came, so that the concatenation lines up with them; a micro-batch that brings another set of
    keys or dtypes (a parameter without a gradient, a new one) lays the segments out anew, the sum moved by
    one gather, a missing key's part zeros copied from the host (no kernel).

    Kernels per regular micro-batch: per dtype group a Concat (not for a single tensor) and a Cast (not for
    float32), a Concat of the groups when more than one, an add (not for the first)."""

    def __init__(self):
        self.flat = None
        self._keys: List = []          # in the flat sum's order
        self._sizes: List[int] = []
        self._dtypes: List = []        # the dtype each key's tensors have had lately (its dtype group)
        self._where: Dict[object, int] = {}
        self.layouts: Dict[object, tuple] = {}   # key -> (shape, dtype) of its first tensor
        self.counts: Dict[object, int] = {}      # key -> tensors added

    def add(self, keyed: Sequence[Tuple[object, object]]) -> None:
        given = dict(keyed)
        for key, tensor in given.items():
            where = self._where.get(key)
            if where is not None and int(tensor.size) != self._sizes[where]:
                raise ValueError(f"a gradient of {int(tensor.size)} elements, {tuple(map(int, tensor.shape))}, "
                                 f"for a sum of {self._sizes[where]}")
        if len(given) != len(self._keys) or any(
                self._where.get(key) is None or self._dtypes[self._where[key]] != tensor.dtype
                for key, tensor in given.items()):
            self._lay_out(given)
        for key, tensor in given.items():
            self.counts[key] = self.counts.get(key, 0) + 1
            self.layouts.setdefault(key, (tensor.shape, tensor.dtype))
        micro = self._concatenated(given)
        if micro is not None:
            self.flat = micro if self.flat is None else self.flat + micro

    def _lay_out(self, given: Dict) -> None:
        """The segments for the keys so far and `given`'s, grouped by dtype; the sum moved to that order."""
        dtypes = {key: dtype for key, dtype in zip(self._keys, self._dtypes)}
        dtypes.update((key, tensor.dtype) for key, tensor in given.items())
        sizes = dict(zip(self._keys, self._sizes))
        sizes.update((key, int(tensor.size)) for key, tensor in given.items())
        group_order = list(dict.fromkeys(dtypes.values()))
        keys = sorted(dtypes, key=lambda key: group_order.index(dtypes[key]))   # stable: first come first
        if self.flat is not None:
            self.flat = self._moved([sizes[key] for key in keys], keys)
        self._keys, self._sizes, self._dtypes = keys, [sizes[key] for key in keys], [dtypes[key] for key in keys]
        self._where = {key: position for position, key in enumerate(keys)}

    def _moved(self, sizes: List[int], keys: List):
        """The flat sum in the order of `keys` (a new key's segment zero): one gather."""
        from mindspore import Tensor, ops

        starts = np.cumsum([0] + self._sizes)
        zero = int(starts[-1])   # the element appended below
        index = np.concatenate([np.arange(starts[self._where[key]], starts[self._where[key]] + size)
                                if key in self._where else np.full(size, zero) for key, size in zip(keys, sizes)]
                               + [np.zeros(0, np.int64)]).astype(np.int32)
        padded = ops.concat([self.flat, Tensor(np.zeros(1, np.float32))])
        return ops.gather(padded, Tensor(index), 0)

    def _concatenated(self, given: Dict):
        """`given`'s tensors in the segments' order as one flat float32 tensor (None: no element)."""
        import mindspore as ms
        from mindspore import Tensor, ops

        groups: Dict[object, List] = {}
        for key, size, dtype in zip(self._keys, self._sizes, self._dtypes):
            if size:
                tensor = given.get(key)
                groups.setdefault(dtype, []).append(   # a missing key's zeros: made on the host
                    tensor.reshape(-1) if tensor is not None else Tensor(np.zeros(size, np.float32), dtype))
        flats = []
        for dtype, pieces in groups.items():
            flat = pieces[0] if len(pieces) == 1 else ops.concat(pieces)
            flats.append(flat if dtype == ms.float32 else flat.astype(ms.float32))
        return None if not flats else flats[0] if len(flats) == 1 else ops.concat(flats)

    def statistics(self, keys: Sequence, ops: Sequence[str], eps: float) -> DeviceRows:
        """The statistics of the sums of `keys` (rows in that order), reduced on the device from the flat
        sum in one set of segment reductions; `read_all` finishes them."""
        ops = tuple(ops)
        sums, extremes = _wanted(ops)
        sizes = tuple(self._sizes)
        rows_of = np.array([self._where[key] for key in keys], dtype=np.int64)
        scalars = np.array([not tuple(self.layouts[key][0]) for key in self._keys], dtype=bool)
        parts = _reductions(self.flat, sizes, sums, extremes, eps) if self.flat is not None else []

        def finish(host: List[np.ndarray]) -> np.ndarray:
            rows = _rows_of(ops, sums, extremes, iter(host), sizes, scalars) if host else \
                _empty_rows(ops, len(sizes))
            rows[np.array(sizes) == 0] = _empty_rows(ops, 1)
            return rows[rows_of]

        return DeviceRows(parts, finish)

    def tensors(self, keys: Sequence) -> List:
        """The sums of `keys` as float32 tensors of their first tensor's shape (one split of the flat sum)."""
        from mindspore import Tensor, ops

        filled = [size for size in self._sizes if size]
        pieces = iter(ops.split(self.flat, filled) if len(filled) > 1 else [self.flat] * len(filled))
        flats = [next(pieces) if size else Tensor(np.zeros(0, np.float32)) for size in self._sizes]
        return [flats[self._where[key]].reshape(tuple(map(int, self.layouts[key][0]))) for key in keys]

    def clear(self) -> None:
        self.flat = None
        self._keys, self._sizes, self._dtypes, self._where = [], [], [], {}
        self.layouts.clear()
        self.counts.clear()


def single_statistics(tensor, ops: Sequence[str], eps: float) -> List[float]:
    """`device_statistics` of one tensor, read now (for tests and one-off reads)."""
    return read_all([device_statistics([tensor], ops, eps)])[0][0].tolist()


__all__ = ["DeviceRows", "EMPTY_STATISTICS", "FlatSums", "group_size", "device_squared_norms", "device_statistics",
           "read_all", "segment_ids", "single_statistics"]
