from hyper_parallel._single_device import multi_device_class, multi_device_function

fully_shard = multi_device_function("hyper_parallel.fully_shard")
MixedPrecisionPolicy = multi_device_class("hyper_parallel.MixedPrecisionPolicy")


class HSDPModule:
    """Only `isinstance(cell, HSDPModule)` is asked on one device: no cell is one."""
