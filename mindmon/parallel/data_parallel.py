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


def _world_rank() -> int:
    from mindspore.communication import GlobalComm, get_rank

    return int(get_rank()) if GlobalComm.INITED else 0


class DataParallel:
    """A communication group (None = the world) with `size`, `rank`, `sum(tensors)` and `max(array)`.

    With one rank both collectives return their input: a single process pays nothing.
    """

    def __init__(self, group: Optional[str] = None):
        self.group = group
        self.size, self.rank = _query(group)

    @classmethod
    def single(cls) -> "DataParallel":
        """A group of this rank alone (an axis of a parallel layout with one rank): both collectives
        return their input."""
        single = cls.__new__(cls)
        single.group, single.size, single.rank = None, 1, 0
        return single

    @property
    def active(self) -> bool:
        return self.size > 1

    def world_ranks(self) -> List[int]:
        """The world ranks of the group's members, in group-rank order (this process alone: [its rank])."""
        if self.group is None:
            return list(range(self.size))
        if not self.active:
            return [_world_rank()]
        from mindspore.communication import get_world_rank_from_group_rank

        return [int(get_world_rank_from_group_rank(self.group, r)) for r in range(self.size)]

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
        return self.gather(values).max(axis=0).reshape(np.shape(values))

    def gather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's float array (the same shape on each), as rows in group-rank order. MindSpore's CPU
        AllGather serves only the world group: in a named group the rows are summed into place (each rank
        fills its own row of zeros; only zeros are added to a rank's row, so NaN and infinities stay)."""
        from mindspore import Tensor, ops

        local = np.asarray(values, np.float32).reshape(1, -1)
        if self.group is None:
            return ops.AllGather()(Tensor(local)).asnumpy()
        rows = np.zeros((self.size, local.shape[1]), np.float32)
        rows[self.rank] = local[0]
        return ops.AllReduce(group=self.group)(Tensor(rows)).asnumpy()
