"""An msrun worker for tests/parallel/test_data_parallel.py: every DataParallel function on a real
two-rank group, against numpy. Prints `dp_worker rank <r>: ok` or the first failed check.
"""
import sys

import numpy as np


def _contribution(rank: int):
    """This rank's tensors for sum(): a matrix, a scalar, integers, a float16 vector."""
    return [np.arange(6, dtype=np.float32).reshape(2, 3) * (rank + 1) + 0.25, np.array(rank + 0.5, np.float32),
            np.array([rank, 2 * rank, 3 * rank, -rank], np.int32), np.array([1.5, -rank], np.float16)]


def _maxima(rank: int) -> np.ndarray:
    return np.array([[1.5, -2.0], [3.0 * rank, 0.25 - rank]], np.float64)


def check_sum(data_parallel, rank: int) -> None:
    from mindspore import Tensor

    mine = _contribution(rank)
    want = [(a.astype(np.float64) + b.astype(np.float64)).astype(a.dtype) for a, b in zip(_contribution(0),
                                                                                          _contribution(1))]
    got = data_parallel.sum([Tensor(a) for a in mine])
    assert len(got) == len(want), got
    for g, w in zip(got, want):
        g = g.asnumpy()
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w), (g, w)
    assert data_parallel.sum([]) == []


def check_max(data_parallel, rank: int) -> None:
    got = data_parallel.max(_maxima(rank))
    want = np.maximum(_maxima(0), _maxima(1))
    assert got.shape == want.shape and np.array_equal(got, want), (got, want)


def checks(rank: int) -> None:
    from mindspore.communication import GlobalComm

    from mindmon.config import ConfigError
    from mindmon.parallel.data_parallel import DataParallel

    world = DataParallel()
    assert (world.size, world.rank, world.active, world.group) == (2, rank, True, None)
    assert world._kwargs() == {}
    check_sum(world, rank)
    check_max(world, rank)
    named = DataParallel(GlobalComm.WORLD_COMM_GROUP)
    assert (named.size, named.rank, named._kwargs()) == (2, rank, {"group": GlobalComm.WORLD_COMM_GROUP})
    check_sum(named, rank)
    check_max(named, rank)
    try:
        DataParallel("no_such_group")
    except ConfigError as error:
        assert str(error) == (
            "monitor.data_parallel_group: got 'no_such_group', a communication group that does not exist (or "
            f"does not hold this rank); allowed: None (the world, {GlobalComm.WORLD_COMM_GROUP!r}) or the name of "
            "a group created with mindspore.communication.create_group before the Trainer is built"), str(error)
    else:
        raise AssertionError("an unknown group was accepted")


def main() -> int:
    import mindspore as ms
    from mindspore.communication import get_rank, init

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank = get_rank()
    try:
        checks(rank)
    except AssertionError as error:
        print(f"dp_worker rank {rank}: FAILED {error}", flush=True)
        return 1
    print(f"dp_worker rank {rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
