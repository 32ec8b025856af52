"""On one device no tensor is distributed: nothing is a DTensor, so MindFormers' `isinstance(x, DTensor)`
checks are False and it takes its plain-Tensor paths."""
from hyper_parallel._single_device import multi_device_function


class DTensor:
    """No instance exists on one device (MindFormers only asks `isinstance(x, DTensor)`)."""

    def __new__(cls, *args, **kwargs):
        raise TypeError("hyper_parallel stand-in: no DTensor exists on one device")


class SkipDTensorDispatch:
    """hyper_parallel's switch that lets DTensor operations run on the local shards; with no DTensor
    there is nothing to switch, so the block runs as it is."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


distribute_tensor = multi_device_function("hyper_parallel.distribute_tensor")
