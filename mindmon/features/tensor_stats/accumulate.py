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

from mindmon.compat import dtype_name, is_float32
from mindmon.features.tensor_stats.monitor import HostTensor, layout
from mindmon.kernels.one_pass import add_at
from mindmon.kernels.stats import StepDirectViews, host_array, float32_memory

logger = logging.getLogger("mindmon")
_FLOAT32 = np.dtype(np.float32)   # numpy's one float32 dtype object: compared by identity in the hook


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
        direct = self.direct_views.allowed()
        # shape and dtype as the tensor gives them: made text once, at the first micro-batch
        shape, dtype, address = float32_memory(grad, direct)
        float32 = bool(address) or is_float32(dtype)
        size = math.prod(shape)
        first = index not in self._sums
        if first:
            flat = self._buffer(index, size, np.float32 if float32 else np.float64)
            shape_ints, dtype_text = layout(shape, dtype)
            self._sums[index] = (name, HostTensor(flat.reshape(shape_ints), dtype_text))
        else:
            flat = self._buffers[index]
        # Copied, not referenced, at the first micro-batch: the hook's buffer may be reused.
        if address and flat.dtype is _FLOAT32 and 0 < size == flat.size:   # read where it lies, no array built
            add_at(flat, address, first)
            return
        if size != flat.size:
            raise ValueError(f"a gradient of {size} elements, {tuple(map(int, shape))}, for a sum of {flat.size}")
        micro = host_array(grad, direct, dtype_name(dtype))
        np.copyto(flat, micro) if first else np.add(flat, micro, out=flat)

    def _buffer(self, index: int, size: int, dtype) -> np.ndarray:
        """The flat memory of one parameter's sum, kept while its size and dtype stay."""
        flat = self._buffers.get(index)
        if flat is None or flat.size != size or flat.dtype != dtype:
            flat = self._buffers[index] = np.empty(size, dtype)
        return flat

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
