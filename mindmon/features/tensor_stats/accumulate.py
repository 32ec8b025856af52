"""The micro-batch gradients of one step, from the parameters' gradient hooks.

`grad_unreduced` is at global-batch granularity: the sum of every micro-batch gradient a parameter's
hook saw in the step (the gradient before any data-parallel reduction). On CPU the sum is kept in numpy
(no kernel dispatch per hook): float32 gradients in float32, as a training step accumulates them (half
the memory traffic of float64, which took a third of the statistics' time), others in float64;
elsewhere it stays on the device.

On CPU a hook only keeps its gradient, in its parameter's list. The lists are added into the sums in one
compiled call when the micro-batch's backward pass ends (before the caller has the gradients: a loop that
accumulates into them in place cannot change what is added) and before the sums are read. At the step's
last micro-batch the same call takes the statistics of each finished sum while it is in cache, so
`grad_unreduced` costs no read of its own.

Elsewhere (the device path) the hooks queue their gradients the same way and a micro-batch's are added
together into one flat float32 sum on the device (`mindmon.kernels.device.FlatSums`: a concatenation per
dtype and one add), whose statistics are read from it by one set of segment reductions: a constant number
of kernels per micro-batch and per step, whatever the number of parameters. Why: in a hook, between MindSpore's kernels, the caches are
cold and each Python call and attribute read costs several times its warm time (measured: about 26 us
for a gradient's shape, dtype and pointer in a hook, 3 us right after).

Where the backward pass ends is learned: while `closer` is None every hook is Python (`add`), and a
micro-batch ends when every hooked parameter has given a gradient or one gives a second; the parameter
whose gradient came last is then the closer (on the host: device hooks stay Python). From the step's end on (the hooks are made again), every
other parameter's hook is its list's own `append` (`append_hook`: a C call, no Python frame per gradient)
and the closer's hook (`close`) adds the lists. A micro-batch in which the closer did not come last (fewer
lists filled than when it was learned, or a list holding two gradients) sends the hooks back to learning.
One case is left: a micro-batch in which the closer's parameter gets no gradient at all (a learned closer
is the first layer a backward pass reaches last, which every micro-batch uses). Its gradients then wait in
their lists for the next micro-batch's closer, which finds lists holding two and sends the hooks back to
learning, or for the optimizer call; a loop that changed those gradients in place before then would change
what is added.
"""
import logging
import math
from collections import deque
from itertools import repeat
from operator import itemgetter
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from mindmon.compat import dtype_name, is_float32
from mindmon.features.tensor_stats.monitor import (ComputedStatistics, HostTensor, host_statistics, layout,
                                                   statistic_codes)
from mindmon.kernels.device import FlatSums
from mindmon.kernels.one_pass import adds_at
from mindmon.kernels.stats import SMALL, StepDirectViews, float32_memories, float32_memory, host_array

logger = logging.getLogger("mindmon")
_FLOAT32 = np.dtype(np.float32)   # numpy's one float32 dtype object: compared by identity


class _Plan:
    """How a micro-batch that gives one float32 gradient to every list goes into the sums, learned from one
    that did: the lists' indices in order, the gradients' shapes, and the compiled add's table (sum address,
    gradient address, size, first, statistics row), whose gradient, first and row columns each flush fills.
    Why: per gradient, reading its memory and making its table row in Python cost 6 us in a hook (warm: 1.5);
    with the plan a micro-batch's gradients are read in a few `map` calls and checked against it at once."""

    def __init__(self, indices: List[int], shapes: List, sums: Dict[int, tuple], sum_addresses: List[int],
                 sizes: List[int]):
        self.indices, self.shapes, self.sums = indices, shapes, sums
        self.table = np.zeros(5 * len(indices), dtype=np.int64)   # flat, as `adds_at` takes it
        self.table[0::5], self.table[2::5] = sum_addresses, sizes
        self.rows = np.arange(len(indices), dtype=np.int64)


class GradientSums:
    """`add(index, name, grad)` from a hook; `for_recording(stats)` (or `named_sums()`) at the optimizer call. With
    `per_micro_batch` nothing is summed: each gradient goes to `on_micro_gradient(name, grad, micro_step)`
    as it comes. `expect(hooked, micro_batches, stats)`: how many hooks give a gradient per micro-batch
    (0: add each at once), and the step's micro-batch count and the TensorStats whose ops and eps the
    finished sums' statistics are taken with (None: taken when asked for)."""

    def __init__(self, on_host: bool, per_micro_batch: bool, on_micro_gradient: Callable):
        self.on_host = on_host
        self.per_micro_batch = per_micro_batch
        self.on_micro_gradient = on_micro_gradient
        self._counts: Dict[int, int] = {}
        self._sums: Dict[int, Tuple[str, object]] = {}
        self._warned = False
        self.direct_views = StepDirectViews()
        # The host sums' memory, kept from step to step: a fresh array each step cost a page fault per
        # 4 KiB on its first write (a copy into fresh memory took twice as long as into used memory).
        self._buffers: Dict[int, np.ndarray] = {}
        self._addresses: Dict[int, int] = {}   # index -> its buffer's data pointer
        self._arrived: Dict[int, list] = {}   # index -> gradients given since the last flush (hooks hold .append)
        self._names: Dict[int, str] = {}
        self._order: List[int] = []            # learning: the indices in the order their gradients came
        self.closer: Optional[int] = None      # the parameter whose gradient ends a micro-batch's backward
        self._filled = 0                       # lists filled in the micro-batch the closer was learned from
        self._hooked, self._micro_batches, self._stats = 0, 0, None
        # index -> (micro-batches summed, statistics row, ops, eps) taken at the last add
        self._finished: Dict[int, tuple] = {}
        self._plan: Optional[_Plan] = None   # for micro-batches that fill every list once
        self._device_sums = FlatSums()      # the device path's sums

    def expect(self, hooked: int, micro_batches: int = 0, stats=None) -> None:
        self._hooked, self._micro_batches, self._stats = hooked, micro_batches, stats

    @property
    def appends(self) -> bool:
        """Whether hooks may be `append_hook`s: host sums, not per micro-batch."""
        return self.on_host and not self.per_micro_batch

    def add(self, index: int, name: str, grad) -> None:
        if self.per_micro_batch:
            micro_step = self._counts.get(index, 0)
            self._counts[index] = micro_step + 1
            self.on_micro_gradient(name, grad, micro_step)
        else:
            arrived = self._list(index, name)
            if arrived:   # a second gradient: the micro-batch before it ended with the last one that came
                self._end_learned_micro_batch()
            arrived.append(grad)
            self._order.append(index)
            if len(self._order) >= self._hooked:
                self._end_learned_micro_batch()

    def append_hook(self, index: int, name: str) -> Callable:
        """A hook that only keeps the gradient (its list's `append`), for a parameter that is not the closer."""
        return self._list(index, name).append

    def close(self, index: int, grad) -> None:
        """The closer's hook: its gradient ends the micro-batch; every list goes into the sums."""
        self._list(index, self._names.get(index, "")).append(grad)
        lengths = list(map(len, self._arrived.values()))
        if len(lengths) - lengths.count(0) < self._filled or max(lengths) > 1:
            self.closer = None   # the backward pass gave its gradients in another order: learn it again
        self.flush()

    def _end_learned_micro_batch(self) -> None:
        if self._order:
            self.closer, self._filled = self._order[-1], len(self._order)
        self.flush()

    def _list(self, index: int, name: str) -> list:
        arrived = self._arrived.get(index)
        if arrived is None:
            arrived = self._arrived[index] = []
            self._names[index] = name
        return arrived

    def flush(self) -> None:
        """The kept gradients into their sums, first of each list first (a list may hold a gradient that
        came after the closer, then the next micro-batch's): float32 ones at their data pointers, all in
        one compiled call per round (with the statistics of the sums they finish), the others through numpy;
        on the device each round into the flat sum."""
        self._order.clear()
        lists = list(self._arrived.values())
        if self.on_host and lists and list(map(len, lists)).count(1) == len(lists) and self._add_planned(lists):
            return
        pending = []
        for index, arrived in self._arrived.items():
            if arrived:
                pending.append((index, arrived.copy()))
                arrived.clear()   # in place: the hooks hold these lists' appends
        rounds = max((len(grads) for _, grads in pending), default=0)
        add = self._add_round if self.on_host else self._add_on_device
        for position in range(rounds):
            add([(index, self._names[index], grads[position]) for index, grads in pending if position < len(grads)])

    def _add_on_device(self, entries: List[Tuple[int, str, object]]) -> None:
        self._device_sums.add([(index, grad) for index, _, grad in entries])
        self._counts.update((index, self._device_sums.counts[index]) for index, _, _ in entries)

    def _add_planned(self, lists: List[list]) -> bool:
        """The one gradient of every list into its sum by the plan; False (nothing done) where it does not
        fit: no plan, other shapes, a gradient not float32 and contiguous, sums at different counts."""
        plan = self._plan
        if plan is None or len(plan.indices) != len(lists):
            return False
        grads = list(map(itemgetter(0), lists))
        shapes, _, addresses = float32_memories(grads, self.direct_views.allowed())
        counts = list(map(self._counts.get, plan.indices, repeat(0)))
        if shapes != plan.shapes or 0 in addresses or counts.count(counts[0]) != len(counts):
            return False
        deque(map(list.clear, lists), maxlen=0)   # in place: the hooks hold these lists' appends
        count = counts[0] + 1
        self._counts.update(zip(plan.indices, repeat(count)))
        if count == 1:
            self._sums.update(plan.sums)
        finishing = plan.indices if self._stats is not None and count == self._micro_batches else []
        plan.table[1::5], plan.table[3::5] = addresses, count == 1
        plan.table[4::5] = plan.rows if finishing else -1
        self._add_table(plan.table, finishing)
        return True

    def _add_round(self, entries: List[Tuple[int, str, object]]) -> None:
        """Gradients of distinct parameters into their sums (one table: no sum is written twice in it). A
        round of every list, all of it added at data pointers, becomes the plan of the next ones."""
        direct = self.direct_views.allowed()
        table, finishing, shapes = [], [], []
        for index, name, grad in entries:
            count = self._counts[index] = self._counts.get(index, 0) + 1
            shape, dtype, address = float32_memory(grad, direct)
            flat, first = self._sum_memory(index, name, shape, dtype, address)
            if address and flat.dtype is _FLOAT32 and 0 < math.prod(shape) == flat.size:
                row = len(finishing) if self._stats is not None and count == self._micro_batches else -1
                if row >= 0:
                    finishing.append(index)
                table += (self._addresses[index], address, flat.size, first, row)
                shapes.append(shape)
                continue
            if math.prod(shape) != flat.size:
                raise ValueError(f"a gradient of {math.prod(shape)} elements, {tuple(map(int, shape))}, "
                                 f"for a sum of {flat.size}")
            micro = host_array(grad, direct, dtype_name(dtype))
            np.copyto(flat, micro) if first else np.add(flat, micro, out=flat)
        if table:
            self._add_table(np.array(table, dtype=np.int64), finishing)
        if len(shapes) == len(entries) == len(self._arrived):
            indices = [index for index, _, _ in entries]
            self._plan = _Plan(indices, shapes, {index: self._sums[index] for index in indices}, table[0::5],
                               table[2::5])

    def _add_table(self, table: np.ndarray, finishing: List[int]) -> None:
        ops, eps = (self._stats.ops, self._stats.eps) if self._stats is not None else ((), 0.0)
        rows, redo = adds_at(table, eps, SMALL, statistic_codes(ops), len(finishing))
        self._finished.update(zip(finishing, zip(map(self._counts.get, finishing), rows, repeat(ops), repeat(eps))))
        for row in redo.tolist():   # NaN or inf: numpy's rules, when the statistics are asked for
            del self._finished[finishing[row]]

    def _sum_memory(self, index: int, name: str, shape, dtype, address: int) -> Tuple[np.ndarray, bool]:
        """The flat sum of `index` and whether this is its first micro-batch (the sum made at it: shape
        and dtype as the tensor gives them, made text once). Copied, not referenced, at the first
        micro-batch: the caller may reuse the gradient's memory."""
        if index in self._sums:
            return self._buffers[index], False
        float32 = bool(address) or is_float32(dtype)
        flat = self._buffer(index, math.prod(shape), np.float32 if float32 else np.float64)
        shape_ints, dtype_text = layout(shape, dtype)
        self._sums[index] = (name, HostTensor(flat.reshape(shape_ints), dtype_text))
        return flat, True

    def _buffer(self, index: int, size: int, dtype) -> np.ndarray:
        """The flat memory of one parameter's sum, kept while its size and dtype stay."""
        flat = self._buffers.get(index)
        if flat is None or flat.size != size or flat.dtype != dtype:
            flat = self._buffers[index] = np.empty(size, dtype)
            self._addresses[index] = flat.ctypes.data   # read once: `ctypes` makes an object at every access
            self._plan = None   # it holds the old memory's address
        return flat

    def named_sums(self) -> List[Tuple[str, object]]:
        """(name, sum) per parameter in index order: host arrays, or float32 tensors on the device."""
        self.flush()
        if not self.on_host:
            indices = sorted(self._device_sums.counts)
            return list(zip(map(self._names.get, indices), self._device_sums.tensors(indices)))
        return [self._sums[index] for index in sorted(self._sums)]

    def for_recording(self, stats):
        """What `grad_unreduced` records into `stats` (a TensorStats): on the host the statistics of every
        sum in its ops and eps, those taken at the sum's last add where they are still its own (nothing
        added since, the same ops and eps), the rest now; on the device the statistics of every sum, reduced
        from the flat sum (read with the step's other device statistics)."""
        if not self.on_host:
            self.flush()
            indices = sorted(self._device_sums.counts)
            return ComputedStatistics(list(map(self._names.get, indices)),
                                      list(map(self._device_sums.layouts.get, indices)),
                                      self._device_sums.statistics(indices, stats.ops, stats.eps), tuple(stats.ops))
        self._end_learned_micro_batch()
        ops, eps = tuple(stats.ops), stats.eps
        indices = sorted(self._sums)
        values = np.empty((len(indices), len(ops)))
        layouts, later = [], []
        for position, index in enumerate(indices):
            sum_tensor = self._sums[index][1]
            layouts.append((sum_tensor.shape, sum_tensor.dtype))
            finished = self._finished.get(index)
            if finished is not None and finished[0] == self._counts.get(index) and finished[2:] == (ops, eps):
                values[position] = finished[1]
            else:
                later.append(position)
        if later:
            values[later] = host_statistics([self._sums[indices[p]][1] for p in later], ops, eps, False)[0]
        return ComputedStatistics([self._sums[index][0] for index in indices], layouts, values, ops)

    def check_count(self, expected: int, step: int) -> None:
        """Every hooked parameter should have seen `grad_acc_steps` micro-batch gradients; say once if not."""
        self.flush()
        counts = sorted(set(self._counts.values()))
        if counts and counts != [expected] and not self._warned:
            self._warned = True
            logger.warning("mindmon: step %d: parameters got %s micro-batch gradients, grad_acc_steps is %d; "
                           "grad_unreduced sums what came", step, counts, expected)

    def clear(self) -> None:
        for arrived in self._arrived.values():
            arrived.clear()
        self._order.clear()
        self._counts.clear()
        self._sums.clear()
        self._finished.clear()
        self._device_sums.clear()
        self.direct_views.forget()

    def release(self) -> None:
        """Monitoring stopped: the host sums' memory (a copy of every monitored gradient) is given back."""
        self.clear()
        self._buffers.clear()
        self._addresses.clear()
        self._arrived.clear()
        self._names.clear()
        self._plan = None
        self.closer = None   # the next attachment may hook other parameters: their order is learned again
