"""Each step's peak memory: the process's resident set on the host, the device's allocator where
MindSpore reports one.

The host figure is Linux's high-water mark of the resident set (`VmHWM` in /proc/self/status), reset at
every step by writing 5 to /proc/self/clear_refs, so each step's figure is that step's own peak, not the
run's. Where the reset is refused (another OS, a locked-down /proc), the figure is the run's peak so far and
`peak_rss_since_start` names it so. The device figures come from `mindspore.runtime.max_memory_allocated`
and `max_memory_reserved`, reset by `reset_peak_memory_stats`; on CPU MindSpore reports 0 for both, and
they are left out.
"""
import logging
from typing import Dict, Optional

logger = logging.getLogger("mindmon")


def status_bytes(field: str) -> Optional[float]:
    """A memory figure of this process from /proc/self/status (`VmRSS`, `VmHWM`, ...) in bytes; None where
    there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return float(line.split()[1]) * 1024   # kB
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Linux resets the process's peak resident set (VmHWM) on writing 5 to clear_refs; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


class MemoryPeaks:
    """`take()`: the peaks since the last `take()` (or since it was made), in bytes, then reset."""

    def __init__(self):
        self.resets = reset_peak_rss()
        self.device = _device_runtime()

    def take(self) -> Dict[str, float]:
        peaks = {}
        host = status_bytes("VmHWM")
        if host is not None:
            peaks["peak_rss" if self.resets else "peak_rss_since_start"] = host
        if self.resets:
            self.resets = reset_peak_rss()
        if self.device is not None:
            peaks.update(self._device_peaks())
        return peaks

    def _device_peaks(self) -> Dict[str, float]:
        try:
            allocated, reserved = self.device.max_memory_allocated(), self.device.max_memory_reserved()
            self.device.reset_peak_memory_stats()
        except Exception as error:   # a runtime without these counters: said once, then left out
            logger.warning("mindmon: monitor.speed: the device's peak memory cannot be read (%s); left out", error)
            self.device = None
            return {}
        if not allocated and not reserved:   # CPU: MindSpore reports 0
            return {}
        return {"device_peak_allocated": float(allocated), "device_peak_reserved": float(reserved)}


def _device_runtime():
    try:
        from mindspore import runtime

        return runtime if hasattr(runtime, "max_memory_allocated") else None
    except ImportError:
        return None
