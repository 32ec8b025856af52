"""`get_platform()`: MindFormers keeps the result at import and calls its communication helpers only
under expert parallelism with overlap, which one device never runs."""
from hyper_parallel._single_device import multi_device_function


class _SingleDevicePlatform:
    def __getattr__(self, name):
        return multi_device_function(f"hyper_parallel platform.{name}")


def get_platform():
    return _SingleDevicePlatform()
