"""`monitor.speed` under MindSpore's own `Model.train` with `ModelMonitorCallback`: a real Model trains a
small net over a real dataset for two epochs. The test's own callbacks, placed before and after mindmon's,
and a clock read inside the optimizer, time the same regions the records describe; throughput comes
from the records' own parts; the FLOPs from the shapes, written out here."""
import time

import numpy as np
import pytest
from mindspore import nn, ops

from tests.support.jsonl import read_jsonl
from mindmon import build_group, parse_sections
from mindmon.core.progress import DATA, FORWARD_BACKWARD, PROGRESS, UPDATE

pytestmark = [pytest.mark.ms27, pytest.mark.serial]   # serial: step times held to a tolerance

BATCHES, EPOCHS, BATCH, FEATURES, HIDDEN = 4, 2, 8, 3, 4
STEPS = BATCHES * EPOCHS
DATA_WAIT = 0.12                 # the dataset's source sleeps this long before each batch
SLOW_STEP, SLOW = 3, 0.30        # the net's forward sleeps in this step
UPDATE_STEP, UPDATE_SLOW = 5, 0.25   # and the optimizer in this one
PLANTED_STEP, PLANTED = 4, 400 * 2 ** 20   # bytes allocated and freed inside this step's forward
# The test's clock reads sit a few statements from the group's (the optimizer's: MindSpore's Cell call between
# its pre-hook and its construct), and a loaded machine may preempt either for a scheduler slice or two: the
# tolerance on a region's time. The planted times are 5x it and more.
TOLERANCE = 0.05


class Batches:
    """A random-access source of whole batches, slow to fetch: Model waits for it between steps."""

    def __init__(self):
        data = np.random.default_rng(0)
        self.x = data.standard_normal((BATCHES, BATCH, FEATURES)).astype(np.float32)
        self.y = (self.x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)

    def __getitem__(self, index):
        time.sleep(DATA_WAIT)
        return self.x[index], self.y[index]

    def __len__(self):
        return BATCHES


class Net(nn.Cell):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen
        self.fc1 = nn.Dense(FEATURES, HIDDEN)
        self.fc2 = nn.Dense(HIDDEN, 1)

    def construct(self, x):
        step = self.seen["step"]
        self.seen["forward_place"][step] = PROGRESS.place[:2]
        if step == SLOW_STEP:
            time.sleep(SLOW)
        if step == PLANTED_STEP:
            planted = np.ones(PLANTED // 8)
            del planted
        return self.fc2(ops.relu(self.fc1(x)))


class TimedSGD(nn.Optimizer):
    """Plain SGD written in Python (MindSpore's own SGD compiles its update, where the test could not read its
    clock), timed from its start; it sleeps in one step."""

    def __init__(self, params, seen):
        super().__init__(0.01, params)
        self.seen = seen

    def construct(self, gradients):
        step = self.seen["step"]
        self.seen["optimizer"][step] = time.perf_counter()
        self.seen["optimizer_place"][step] = PROGRESS.place[:2]
        if step == UPDATE_STEP:
            time.sleep(UPDATE_SLOW)
        for parameter, gradient in zip(self._parameters, gradients):
            ops.assign(parameter, parameter - 0.01 * gradient)
        return True


def _train(tmp_path, speed):
    import mindspore.dataset as ds
    from mindspore.train import Callback, Model

    from mindmon.callbacks import ModelMonitorCallback

    seen = {"step": 0, "begin": {}, "end": {}, "after": {}, "optimizer": {}, "forward_place": {},
            "optimizer_place": {}, "after_place": {}}
    net = Net(seen)
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path), "speed": speed}}), model=net)

    class Before(Callback):   # placed before mindmon's callback: its step begins first and ends first
        def on_train_step_begin(self, run_context):
            seen["step"] = run_context.original_args().cur_step_num
            seen["begin"][seen["step"]] = time.perf_counter()

        def on_train_step_end(self, run_context):
            seen["end"][seen["step"]] = time.perf_counter()

    class After(Callback):    # placed after it: its step ends once mindmon has written the step
        def on_train_step_end(self, run_context):
            seen["after"][seen["step"]] = time.perf_counter()
            seen["after_place"][seen["step"]] = PROGRESS.place[:2]

    dataset = ds.GeneratorDataset(Batches(), ["x", "y"], shuffle=False)
    model = Model(net, nn.MSELoss(), TimedSGD(net.trainable_params(), seen))
    model.train(EPOCHS, dataset, callbacks=[Before(), ModelMonitorCallback(group), After()], dataset_sink_mode=False)
    records = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    by_step = {s: {(r["kind"], r["name"], r["micro_step"]): r["value"] for r in records if r["step"] == s}
               for s in range(1, STEPS + 1)}
    return by_step, seen


PHASES = ("data", "forward_backward", "reduce", "update", "mindmon", "other")


def test_model_train_step_time_against_the_tests_clock(tmp_path):
    by_step, seen = _train(tmp_path, {"enabled": True})
    assert set(seen["end"]) == set(range(1, STEPS + 1))
    for step in range(2, STEPS + 1):
        got = by_step[step]
        time_of = {name: got[("step_time", name, None)] for name in PHASES + ("step",)}
        # the window: from the previous step's end to this one's, as the callback before mindmon's saw them
        assert time_of["step"] == pytest.approx(seen["end"][step] - seen["end"][step - 1], abs=TOLERANCE)
        assert sum(time_of[p] for p in PHASES) == pytest.approx(time_of["step"], abs=1e-9)
        # waiting for the batch: from the previous step written (the callback after mindmon's) to this one's begin
        assert time_of["data"] == pytest.approx(seen["begin"][step] - seen["after"][step - 1], abs=TOLERANCE)
        # forward and backward: from the step's begin to the optimizer's call
        assert time_of["forward_backward"] == pytest.approx(seen["optimizer"][step] - seen["begin"][step],
                                                            abs=TOLERANCE)
        if step != PLANTED_STEP:   # (filling the planted array takes its own time)
            assert (time_of["forward_backward"] >= SLOW) == (step == SLOW_STEP)
        # a plain TrainOneStepCell tells no update's end: the optimizer's time is under `other`
        assert time_of["update"] == 0.0 and time_of["reduce"] == pytest.approx(0.0, abs=1e-3)
        assert time_of["other"] == pytest.approx(seen["end"][step] - seen["optimizer"][step], abs=TOLERANCE)
        assert (time_of["other"] >= UPDATE_SLOW) == (step == UPDATE_STEP)
        assert got[("step_time", "micro_batch", 0)] == time_of["forward_backward"]
        # throughput: the batch's samples (and its first column's second dimension as tokens) over the window
        assert got[("throughput", "samples_per_second", None)] == pytest.approx(BATCH / time_of["step"], rel=1e-12)
        assert got[("throughput", "tokens_per_second", None)] == pytest.approx(BATCH * FEATURES / time_of["step"],
                                                                              rel=1e-12)


def test_model_train_eta_memory_and_the_watchdog_s_place(tmp_path):
    by_step, seen = _train(tmp_path, {"enabled": True})
    # the run's last step: the dataset's batches times the epochs
    assert ("eta", "seconds", None) not in by_step[1]
    for step in range(2, STEPS + 1):
        mean = np.mean([by_step[s][("step_time", "step", None)] for s in range(2, step + 1)])
        assert by_step[step][("eta", "seconds", None)] == pytest.approx((STEPS - step) * mean, rel=1e-9)
    assert by_step[STEPS][("eta", "seconds", None)] == 0.0
    peaks = {s: by_step[s][("memory", "peak_rss", None)] for s in range(2, STEPS + 1)}
    others = [peaks[s] for s in peaks if s != PLANTED_STEP]
    assert peaks[PLANTED_STEP] >= min(others) + 0.95 * PLANTED
    assert max(others) < min(others) + 0.5 * PLANTED
    # where the peer watchdog's heartbeat says this process is, read inside the step
    for step in range(1, STEPS + 1):
        assert seen["forward_place"][step] == (step, FORWARD_BACKWARD)
        assert seen["optimizer_place"][step] == (step, UPDATE)
        assert seen["after_place"][step] == (step + 1, DATA)   # written: waiting for the next batch


def test_model_train_flops_and_mfu(tmp_path):
    peak_tflops = 0.001
    by_step, _ = _train(tmp_path, {"enabled": True, "flops": True, "peak_tflops": peak_tflops})
    # two Dense matmuls per forward, forward plus the two gradients of each: 3x
    forward = 2 * BATCH * FEATURES * HIDDEN + 2 * BATCH * HIDDEN * 1
    for step in range(1, STEPS + 1):
        got = by_step[step]
        assert got[("flops", "useful", None)] == 3 * forward
        assert got[("flops", "executed", None)] == 3 * forward
        seconds = got[("step_time", "step", None)]
        assert got[("mfu", "mfu", None)] == pytest.approx(3 * forward / seconds / (peak_tflops * 1e12), rel=1e-12)
        assert got[("mfu", "peak_tflops", None)] == peak_tflops
