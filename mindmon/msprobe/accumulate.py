"""The micro-batch gradients of one step, from the parameters' gradient hooks.

`grad_unreduced` is at global-batch granularity: the sum of every micro-batch gradient a parameter's
hook saw in the step (the gradient before any data-parallel reduction). On CPU the sum is kept in numpy
(no kernel dispatch per hook): float32 gradients in float32, as a training step accumulates them (half
the memory traffic of float64, which took a third of the statistics' time), others in float64;
elsewhere it stays on the device.
"""
import logging
import math
from typing import Callable, Dict, List, Tuple

import numpy as np

from ..monitors.tensor_stats import HostTensor, describe
from ..one_pass import add_at
from ..stats import StepDirectViews, _host_array, direct_location

logger = logging.getLogger("mindmon")


class GradientSums:
    """`add(index, name, grad)` from a hook; `named_sums()` at the optimizer call. With `per_micro_batch`
    nothing is summed: each gradient goes to `on_micro_gradient(name, grad, micro_step)` as it comes."""

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

    def add(self, index: int, name: str, grad) -> None:
        micro_step = self._counts.get(index, 0)
        self._counts[index] = micro_step + 1
        if self.per_micro_batch:
            self.on_micro_gradient(name, grad, micro_step)
        elif self.on_host:
            self._add_on_host(index, name, grad)
        else:
            previous = self._sums.get(index)
            self._sums[index] = (name, grad if previous is None else previous[1] + grad)

    def _add_on_host(self, index: int, name: str, grad) -> None:
        shape, dtype = describe(grad)
        known = self._sums.get(index)
        if known is None:
            array = self._buffer(index, shape, np.float32 if dtype == "Float32" else np.float64)
            self._sums[index] = (name, HostTensor(array, dtype))
        else:
            array = known[1].array
        first = known is None
        location = (direct_location(grad, dtype, math.prod(shape))
                    if dtype == "Float32" and array.dtype == np.float32 and self.direct_views.allowed() else None)
        # Copied, not referenced, at the first micro-batch: the hook's buffer may be reused.
        if location is not None and 0 < location.size == array.size:   # read where it lies, no array built
            add_at(array.reshape(-1), location.address, first)
            return
        flat = _host_array(grad, self.direct_views.allowed(), dtype).reshape(array.shape)
        np.copyto(array, flat) if first else np.add(array, flat, out=array)

    def _buffer(self, index: int, shape: tuple, dtype) -> np.ndarray:
        array = self._buffers.get(index)
        if array is None or array.shape != shape or array.dtype != dtype:
            array = self._buffers[index] = np.empty(shape, dtype)
        return array

    def named_sums(self) -> List[Tuple[str, object]]:
        return [self._sums[index] for index in sorted(self._sums)]

    def check_count(self, expected: int, step: int) -> None:
        """Every hooked parameter should have seen `grad_acc_steps` micro-batch gradients; say once if not."""
        counts = sorted(set(self._counts.values()))
        if counts and counts != [expected] and not self._warned:
            self._warned = True
            logger.warning("mindmon: step %d: parameters got %s micro-batch gradients, grad_acc_steps is %d; "
                           "grad_unreduced sums what came", step, counts, expected)

    def clear(self) -> None:
        self._counts.clear()
        self._sums.clear()
        self.direct_views.forget()

    def release(self) -> None:
        """Monitoring stopped: the host sums' memory (a copy of every monitored gradient) is given back."""
        self.clear()
        self._buffers.clear()
