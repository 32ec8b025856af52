"""`monitor.speed`'s device clock (mindmon/features/speed/device_marks.py) on the CPU machine the suite runs on:
a CPU run creates no MindSpore timing event and adds no synchronisation, and the device path, forced here,
meets MindSpore 2.9's refusal of events on CPU, says so once and falls back to the host stamps. The device
path's own timing (Ascend, GPU) cannot run here."""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, runtime

from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
from mindmon.core.events import MicroBatchEnd, StepBegin, StepEnd, UpdateDone
from mindmon.features.speed.device_marks import DeviceMarks
from mindmon.features.speed.monitor import SpeedMonitor
from tests.support.scripts.plain_loop_job import Regression


class Counted:
    """Counts the calls of a MindSpore runtime function or class, then calls it."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def test_a_cpu_run_creates_no_device_event_and_adds_no_synchronisation(tmp_path, monkeypatch):
    assert ms.get_context("device_target") == "CPU"
    events, synchronize = Counted(runtime.Event), Counted(runtime.synchronize)
    monkeypatch.setattr(runtime, "Event", events)
    monkeypatch.setattr(runtime, "synchronize", synchronize)
    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path), "speed": {"enabled": True}}}))
    train_step = AccumulatingTrainStep(lambda x, y: net(x, y), optimizer, num_micro_steps=2, group=group)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    group.setup()
    for step in (1, 2, 3):
        train_step(split_batch((Tensor(x), Tensor(x[:, :1])), 2))
        group.flush(step)
    speed = [m for m in group.monitors if isinstance(m, SpeedMonitor)]
    group.close()
    assert len(speed) == 1 and speed[0].device_marks is None
    assert events.calls == 0 and synchronize.calls == 0


def test_the_device_path_is_chosen_by_the_device_target():
    assert DeviceMarks.for_device_target("CPU") is None
    assert isinstance(DeviceMarks.for_device_target("Ascend"), DeviceMarks)
    assert isinstance(DeviceMarks.for_device_target("GPU"), DeviceMarks)


def test_the_device_path_on_cpu_says_once_and_falls_back_to_the_host_stamps(caplog):
    """MindSpore 2.9 on CPU refuses the process's first Event(enable_timing=True) (no other test makes one):
    the monitor says so once and times the step's phases on the host stamps, as on CPU."""
    monitor = SpeedMonitor(rank=0)
    monitor.device_marks = DeviceMarks.for_device_target("Ascend")   # what an Ascend process would build
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        for step in (1, 2):
            monitor.reset()
            events = (StepBegin(), MicroBatchEnd(0, 8, 24), UpdateDone(), StepEnd(step))
            for at, event in zip((10.0, 10.25, 10.5, 10.75), events):
                event.at = at + step
                monitor.on_event(event)
            got = {r.name: r.value for r in monitor.collect(step) if r.kind == "step_time" and r.micro_step is None}
            assert got["forward_backward"] == pytest.approx(0.25)
    assert monitor.device_marks.failed
    lines = [r.getMessage() for r in caplog.records if "timing events" in r.getMessage()]
    assert len(lines) == 1 and "timed on the host" in lines[0], lines
