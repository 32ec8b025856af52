"""The data-parallel group mindmon reduces over, and its two collectives.

Every cross-rank value of a step travels in one packed SUM all-reduce (gradients, the loss, MoE
token totals) and, on steps where max logits are printed, one all-gather (MAX is taken on the
gathered values: MindSpore's CPU AllReduce supports only SUM). Never one collective per tensor.

Example (inside a process started by msrun, after `mindspore.communication.init("mccl")`):
    data_parallel = DataParallel()            # the world; DataParallel("dp_group_name") on Ascend
    grads = data_parallel.sum(list(grads))    # one collective for all of them
    worst = data_parallel.max(np.array([1.5, 12.25]))
"""
from typing import List, Optional, Sequence

import numpy as np

from mindmon.config import ConfigError


def _query(group: Optional[str]):
    """(size, rank) of the group, or (1, 0) when communication was never initialised (one process).

    Once communication is initialised, a named group that does not exist is a ConfigError: falling
    back to a world of one would silently stop the gradient averaging."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    if not GlobalComm.INITED:
        return 1, 0
    if group is None:
        return int(get_group_size()), int(get_rank())
    try:
        return int(get_group_size(group)), int(get_rank(group))
    except RuntimeError:
        raise ConfigError(f"monitor.data_parallel_group: got {group!r}, a communication group that does not "
                          f"exist (or does not hold this rank); allowed: None (the world, "
                          f"{GlobalComm.WORLD_COMM_GROUP!r}) or the name of a group created with "
                          f"mindspore.communication.create_group before the Trainer is built") from None


class DataParallel:
    """A communication group (None = the world) with `size`, `rank`, `sum(tensors)` and `max(array)`.

    With one rank both collectives return their input: a single process pays nothing.
    """

    def __init__(self, group: Optional[str] = None):
        self.group = group
        self.size, self.rank = _query(group)

    @property
    def active(self) -> bool:
        return self.size > 1

    def _kwargs(self) -> dict:
        return {} if self.group is None else {"group": self.group}

    def sum(self, tensors: Sequence) -> List:
        """The element-wise sum over the group of each tensor, in one collective: the tensors are
        flattened into one float32 buffer, all-reduced and cut back into their shapes and dtypes."""
        if not self.active or not tensors:
            return list(tensors)
        from mindspore import mint, ops
        import mindspore as ms

        flat = mint.cat([t.reshape(-1).astype(ms.float32) for t in tensors])
        reduced = ops.AllReduce(**self._kwargs())(flat)
        sizes = [int(np.prod(t.shape)) if t.shape else 1 for t in tensors]
        pieces = mint.split(reduced, sizes)
        return [p.reshape(t.shape).astype(t.dtype) for p, t in zip(pieces, tensors)]

    def max(self, values: np.ndarray) -> np.ndarray:
        """The element-wise max over the group of a float array (every rank passes the same shape)."""
        if not self.active:
            return values
        from mindspore import Tensor, ops

        local = Tensor(np.asarray(values, np.float32).reshape(1, -1))
        gathered = ops.AllGather(**self._kwargs())(local).asnumpy()
        return gathered.max(axis=0).reshape(np.shape(values))
