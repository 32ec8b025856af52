"""`monitor.speed` on one rank: every time a record holds against the test's own clock around the same
region, the phases adding up to the step, throughput from the records' own parts, a planted allocation in
the step's peak memory, the ETA."""
import time

import numpy as np
import pytest
from mindspore import Tensor, nn

from tests.support.jsonl import read_jsonl
from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
from mindmon.config import ConfigError
from tests.support.scripts.plain_loop_job import Regression

pytestmark = [pytest.mark.ms27, pytest.mark.serial]   # serial: times the steps it checks

STEPS, K, SAMPLES = 5, 2, 8
SLOW_STEP, SLOW_MICRO, SLOW = 3, 1, 0.30    # a sleep in one micro-batch's forward
DATA_WAIT = 0.12                            # the loop sleeps this long before each step's batch
OTHER = 0.05                                # and this long between the update and the step's end
PLANTED = 400 * 2 ** 20                     # bytes allocated and freed inside step 4
# The test's clock reads sit a few statements from the group's, and a loaded machine may preempt either for a
# scheduler slice: the tolerance on a region's time. The planted times are 5x it and more.
TOLERANCE = 0.02


def _batches(rng):
    x = rng.normal(size=(SAMPLES, 3)).astype(np.float32)
    return Tensor(x), Tensor((x @ np.array([[1.0], [-2.0], [0.5]])).astype(np.float32))


def _run(tmp_path, rng):
    """A plain loop with sleeps in known places; returns the records by step and the test's own clock."""
    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path), "speed": {"enabled": True},
                                                    "train_state": {"local_loss": True}}}),
                        parameter_names=[p.name for p in optimizer.parameters])
    calls = {"step": 0, "micro": 0}

    def loss_fn(x, y):
        if calls["step"] == SLOW_STEP and calls["micro"] == SLOW_MICRO:
            time.sleep(SLOW)
        calls["micro"] += 1
        return net(x, y)

    train_step = AccumulatingTrainStep(loss_fn, optimizer, num_micro_steps=K, group=group, max_norm=0.0)
    group.setup(max_steps=10)
    clock = {"flush": {}, "data": {}, "train": {}, "other": {}}
    batch = _batches(rng)
    for step in range(1, STEPS + 1):
        calls["step"], calls["micro"] = step, 0
        started = time.perf_counter()
        time.sleep(DATA_WAIT)
        clock["data"][step] = time.perf_counter() - started
        started = time.perf_counter()
        train_step(split_batch(batch, K))
        clock["train"][step] = time.perf_counter() - started
        started = time.perf_counter()
        if step == 4:
            planted = np.ones(PLANTED // 8)
            del planted
        time.sleep(OTHER)
        clock["other"][step] = time.perf_counter() - started
        clock["flush"][step] = time.perf_counter()
        group.flush(step)
    group.close()
    records = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    by_step = {s: {(r["kind"], r["name"], r["micro_step"]): r["value"] for r in records if r["step"] == s}
               for s in range(1, STEPS + 1)}
    return by_step, clock


def test_step_time_phases_and_throughput_against_the_tests_clock(tmp_path, rng):
    by_step, clock = _run(tmp_path, rng)
    for step in range(2, STEPS + 1):
        got = by_step[step]
        time_of = {name: got[("step_time", name, None)] for name in
                   ("step", "data", "forward_backward", "reduce", "update", "mindmon", "other", "compute")}
        # the window: from the previous step's end to this one's, as the test saw the flush calls
        assert time_of["step"] == pytest.approx(clock["flush"][step] - clock["flush"][step - 1], abs=TOLERANCE)
        parts = sum(time_of[p] for p in ("data", "forward_backward", "reduce", "update", "mindmon", "other"))
        assert parts == pytest.approx(time_of["step"], abs=1e-9)
        assert time_of["data"] == pytest.approx(clock["data"][step], abs=TOLERANCE)
        assert time_of["other"] == pytest.approx(clock["other"][step], abs=TOLERANCE)
        # the train step's call holds forward/backward, the update and mindmon's event handling in it
        inside = time_of["forward_backward"] + time_of["reduce"] + time_of["update"]
        assert inside <= clock["train"][step] + 1e-4
        assert inside >= clock["train"][step] - time_of["mindmon"] - TOLERANCE
        micro = [got[("step_time", "micro_batch", k)] for k in range(K)]
        assert sum(micro) == pytest.approx(time_of["forward_backward"], abs=1e-9)
        slowed = step == SLOW_STEP
        assert (micro[SLOW_MICRO] >= SLOW) == slowed
        assert time_of["compute"] >= time_of["forward_backward"]
        rates = {name: got[("throughput", name, None)] for name in
                 ("samples_per_second", "job_samples_per_second")}
        assert rates["samples_per_second"] == pytest.approx(SAMPLES / time_of["step"], rel=1e-12)
        assert rates["job_samples_per_second"] == pytest.approx(SAMPLES / time_of["step"], rel=1e-12)
        # tokens: the first column (8, 3) is read as 8 sequences of 3 tokens
        assert got[("throughput", "tokens_per_second", None)] == pytest.approx(SAMPLES * 3 / time_of["step"])
        assert abs(got[("wall_clock", "step_end", None)] - time.time()) < 60


def test_eta_is_the_mean_step_time_times_the_steps_left(tmp_path, rng):
    by_step, _ = _run(tmp_path, rng)
    assert ("eta", "seconds", None) not in by_step[1]
    for step in range(2, STEPS + 1):
        mean = np.mean([by_step[s][("step_time", "step", None)] for s in range(2, step + 1)])
        assert by_step[step][("eta", "seconds", None)] == pytest.approx((10 - step) * mean, rel=1e-9)


def test_a_planted_allocation_shows_in_its_steps_peak_memory(tmp_path, rng):
    by_step, _ = _run(tmp_path, rng)
    peaks = {s: by_step[s][("memory", "peak_rss", None)] for s in range(2, STEPS + 1)}
    others = [peaks[s] for s in peaks if s != 4]
    assert peaks[4] >= min(others) + 0.95 * PLANTED
    assert max(others) < min(others) + 0.5 * PLANTED   # reset every step: step 5 does not carry step 4's peak


@pytest.mark.parametrize("section, message", [
    ({"enabled": "yes"}, "monitor.speed.enabled: got 'yes'"),
    ({"slow_rank_factor": 1.0}, "monitor.speed.slow_rank_factor: got 1.0; allowed: a finite number > 1"),
    ({"peak_tflops": -3}, "monitor.speed.peak_tflops: got -3"),
    ({"hang_afterr": 3}, "hang_after"),
])
def test_bad_values_are_refused_in_one_line(section, message):
    with pytest.raises(ConfigError) as error:
        parse_sections({"monitor": {"speed": section}})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_log_line_carries_the_records_and_parse_log_reads_it_back(tmp_path, rng, caplog):
    import logging

    from mindmon.analysis.parse_log import parse_log

    with caplog.at_level(logging.INFO, logger="mindmon"):
        by_step, _ = _run(tmp_path / "run", rng)
    lines = [line for r in caplog.records for line in r.getMessage().split("\n") if "step_time:" in line]
    assert len(lines) == STEPS
    line = lines[2]
    assert line.startswith("step:[    3/   10] step_time: ")
    got = by_step[3]
    assert f"step_time: {got[('step_time', 'step', None)] * 1e3:.1f}ms (data " in line
    assert "eta: 0:00:" in line and "samples/s: " in line and "peak_rss: " in line
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    parse_log(str(log), str(tmp_path / "parsed"), progress=None)
    parsed = {(r["step"], r["kind"], r["name"]): r["value"] for r in read_jsonl(tmp_path / "parsed" / "rank_0" / "metrics.jsonl")}
    for step in range(1, STEPS + 1):
        for name in ("step", "data", "forward_backward", "reduce", "update", "mindmon", "other"):
            assert parsed[(step, "step_time", name)] == pytest.approx(by_step[step][("step_time", name, None)], abs=5e-5)
        assert parsed[(step, "throughput", "samples_per_second")] == pytest.approx(
            by_step[step][("throughput", "samples_per_second", None)], rel=1e-5)
        assert parsed[(step, "memory", "peak_rss")] == pytest.approx(by_step[step][("memory", "peak_rss", None)],
                                                                     abs=0.06 * 2 ** 20)
    for step in range(2, STEPS + 1):
        assert parsed[(step, "eta", "seconds")] == pytest.approx(by_step[step][("eta", "seconds", None)], abs=0.5)


class _TwoDense(nn.Cell):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Dense(3, 4), nn.Dense(4, 1)

    def construct(self, x, y):
        diff = self.second(self.first(x)) - y
        return (diff * diff).mean()


def _flop_run(tmp_path, rng, speed):
    net = _TwoDense()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path), "speed": speed}}), model=net,
                        parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=K, group=group, max_norm=0.0)
    group.setup()
    batch = _batches(rng)
    for step in (1, 2, 3):
        train_step(split_batch(batch, K))
        group.flush(step)
    group.close()
    records = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    return {(r["step"], r["kind"], r["name"]): r["value"] for r in records}


def test_flops_and_mfu_of_a_step_equal_the_hand_count(tmp_path, rng):
    got = _flop_run(tmp_path, rng, {"enabled": True, "flops": True, "peak_tflops": 2e-6})
    rows = SAMPLES // K
    # per micro-batch: x (rows, 3) @ (3, 4) and h (rows, 4) @ (4, 1), 2mnk each; forward + two gradients = 3x
    per_step = K * 3 * (2 * rows * 3 * 4 + 2 * rows * 4 * 1)
    for step in (1, 2, 3):
        assert got[(step, "flops", "executed")] == per_step
        assert got[(step, "flops", "useful")] == per_step     # nothing recomputed, no experts, no attention
        seconds = got[(step, "step_time", "step")]
        assert got[(step, "mfu", "mfu")] == pytest.approx(per_step / seconds / 2e6, rel=1e-12)
        assert got[(step, "mfu", "hfu")] == pytest.approx(per_step / seconds / 2e6, rel=1e-12)
        assert got[(step, "mfu", "peak_tflops")] == pytest.approx(2e-6)


def test_an_unknown_device_gives_no_mfu_and_says_so_once(tmp_path, rng, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="mindmon"):
        got = _flop_run(tmp_path, rng, {"enabled": True, "flops": True})
    assert not any(kind == "mfu" for _, kind, _ in got)
    assert got[(2, "flops", "executed")] > 0
    said = [r.getMessage() for r in caplog.records if "no MFU" in r.getMessage()]
    assert said == ["mindmon: no peak for device 'CPU' in mindmon's table (docs/flops.md); no MFU is reported. "
                    "Allowed: set monitor.speed.peak_tflops to the device's dense TFLOP/s for float32"]


def test_a_throughput_drop_is_named_at_its_step_only(tmp_path, rng, caplog):
    import logging

    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path), "speed": {
        "enabled": True, "throughput_drop": 0.5}}}), parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=K, group=group, max_norm=0.0)
    group.setup(max_steps=9)
    batch = _batches(rng)
    with caplog.at_level(logging.INFO, logger="mindmon"):
        for step in range(1, 10):
            time.sleep(0.05 if step != 7 else 0.6)   # step 7 waits 12x longer for its data
            train_step(split_batch(batch, K))
            group.flush(step)
    group.close()
    records = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    rates = {r["step"]: r["value"] for r in records if (r["kind"], r["name"]) == ("throughput", "samples_per_second")}
    drops = [(r["step"], r["value"]) for r in records if r["kind"] == "throughput_drop"]
    assert [step for step, _ in drops] == [7]
    assert drops[0][1] == pytest.approx(rates[7] / np.median([rates[s] for s in range(1, 7)]), rel=1e-12)
    assert any(f"step:[    7/    9] throughput drop: samples/s at {drops[0][1]:.2f}x the median" in line
               for r in caplog.records for line in r.getMessage().split("\n"))
