"""Counting the kernels MindSpore launches while a block of code runs, by MindSpore's own profiler.

Off the CPU every statistic the device path takes is a MindSpore operation dispatched from Python; what
bounds a step there is how many it dispatches, not their arithmetic. MindSpore's profiler records every
kernel it launches (on CPU: `FRAMEWORK/cpu_op_execute_timestamp_*.txt`, a line per kernel name with the start of each of
its launches);
read without its analysis (a tenth of a second, not seconds), that is an exact count. A view (the reshape of
a contiguous tensor) launches no kernel and is not counted; a host-to-device copy of a numpy array is not
an operation either.

Example:
    with count_kernel_launches() as launched:
        norms = SquaredNorms(on_host=False)
        norms.add("g", grads)
    launched.count, launched.names   # 5, [Concat, Square, then UnsortedSegmentSum three times]

Kernels queued before the block are waited for first, and the block's own before the count is read.
Not for timing: the profiler slows each launch down.
"""
import glob
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator, List, Tuple


class KernelLaunches:
    """The kernels launched in a `count_kernel_launches` block, in order (names as the profiler gives them,
    without the graph scope MindSpore puts before some: `Default/IsNan-op0` is `IsNan`)."""

    def __init__(self):
        self.names: List[str] = []

    @property
    def count(self) -> int:
        return len(self.names)


def _wait_for_queued_kernels() -> None:
    """Every kernel launched so far has run (PyNative queues them; the profiler records a kernel when it runs)."""
    try:
        from mindspore.graph.api import _pynative_executor
    except ImportError:   # before MindSpore 2.9
        from mindspore.common.api import _pynative_executor
    _pynative_executor.sync()


def _launches(line: str) -> List[Tuple[int, str]]:
    """(start in ns, kernel name) of each launch on one line of the profiler's file: `name;type;` then one
    `start,duration,stream` per launch of that kernel, separated by spaces."""
    name, _, launches = line.split(";", 2)
    name = name.rsplit("/", 1)[-1]
    base, _, suffix = name.rpartition("-op")
    name = base if base and suffix.isdigit() else name
    return [(int(launch.split(",", 1)[0]), name) for launch in launches.split()]


@contextmanager
def count_kernel_launches() -> Iterator[KernelLaunches]:
    """The kernels MindSpore launches inside the block (see the module's text)."""
    import mindspore as ms
    from mindspore.profiler import ProfilerActivity

    launched = KernelLaunches()
    folder = tempfile.mkdtemp(prefix="mindmon-kernels-")
    try:
        _wait_for_queued_kernels()
        # recording from here (`start_profile` is on): no analysis, only the raw files read below
        profiler = ms.profiler.profile(activities=[ProfilerActivity.CPU], on_trace_ready=(
            ms.profiler.tensorboard_trace_handler(folder, analyse_flag=False)))
        try:
            yield launched
            _wait_for_queued_kernels()
        finally:
            profiler.stop()
        found = []
        for path in glob.glob(os.path.join(folder, "**", "cpu_op_execute_timestamp_*.txt"), recursive=True):
            with open(path) as handle:
                found += [launch for line in handle if line.strip() for launch in _launches(line)]
        launched.names = [name for _, name in sorted(found)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["KernelLaunches", "count_kernel_launches"]
