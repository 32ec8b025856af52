"""What the stand-in gives for hyper_parallel's multi-device machinery: a name that imports, and that
says, when used, that this is the single-device stand-in (tests/support/hyper_parallel_standin/README.md)."""


class MultiDeviceOnly(RuntimeError):
    """A multi-device part of hyper_parallel was called under the single-device stand-in."""


def _refuse(name):
    raise MultiDeviceOnly(f"hyper_parallel stand-in: {name} is multi-device parallelism, which this "
                          f"single-device stand-in for the tests does not provide")


def multi_device_class(name):
    """A class MindFormers imports by name; making one raises MultiDeviceOnly."""
    def __init__(self, *args, **kwargs):
        _refuse(name)

    return type(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__doc__": f"Stand-in for {name}."})


def multi_device_function(name):
    """A function MindFormers imports by name; calling it raises MultiDeviceOnly."""
    def refuse(*args, **kwargs):
        _refuse(name)

    refuse.__name__ = name.rsplit(".", 1)[-1]
    return refuse
