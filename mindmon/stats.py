"""Batched tensor statistics with no host sync per tensor.

On CPU, `Tensor.asnumpy()` returns a view of the tensor's memory, so squared norms are taken in
numpy: no kernel dispatch per parameter. Elsewhere they are reduced on the device, stacked into
one tensor per call and copied to the host once, when `results()` is read at flush.

Example:
    norms = SquaredNorms(on_host=True)
    norms.add(("accumulated", 0), grads)
    norms.results()[("accumulated", 0)]  # np.ndarray, one float64 per tensor
"""
from typing import Dict, Hashable, Sequence

import numpy as np


def host_is_device() -> bool:
    """True when tensors live in host memory (MindSpore's CPU target)."""
    import mindspore as ms

    return ms.get_context("device_target") == "CPU"


def _host_squared_norm(tensor) -> float:
    import mindspore as ms

    if tensor.dtype == ms.bfloat16:  # numpy has no bfloat16
        tensor = tensor.astype(ms.float32)
    flat = tensor.asnumpy().reshape(-1)
    if flat.dtype != np.float64:
        flat = flat.astype(np.float64)
    return float(np.dot(flat, flat))


class SquaredNorms:
    """Collects the squared L2 norm of every tensor in a list, per key; one transfer per key at most."""

    def __init__(self, on_host: bool):
        self.on_host = on_host
        self._pending: Dict[Hashable, object] = {}

    def add(self, key: Hashable, tensors: Sequence) -> None:
        if not tensors:
            return
        if self.on_host:
            self._pending[key] = np.array([_host_squared_norm(t) for t in tensors], dtype=np.float64)
        else:
            from mindspore import mint, ops

            self._pending[key] = ops.stack([mint.sum(mint.square(t.float())) for t in tensors])

    def results(self) -> Dict[Hashable, np.ndarray]:
        out = {}
        for key, value in self._pending.items():
            out[key] = value if isinstance(value, np.ndarray) else value.asnumpy().astype(np.float64)
        return out

    def clear(self) -> None:
        self._pending.clear()


def to_float(value) -> float:
    """A Python float from a float, numpy scalar or 0-dim tensor (one host read)."""
    if hasattr(value, "asnumpy"):
        return float(value.asnumpy())
    return float(value)
