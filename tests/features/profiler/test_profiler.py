"""The `profiler:` section on the real MindFormers Trainer and the real MindSpore Profiler (CPU).

Which step an operator ran in is decided from wall-clock times a test callback takes at every step
end, compared with the operator timestamps in the trace_view.json MindSpore writes (both are epoch
time); no mindmon output is used for that.
"""
import copy
import csv
import glob
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.support.bad_profiler import BAD_PROFILER_SECTIONS
from tests.support.demo_trainer import make_data, make_model, mindformers_log, trainer_config

from mindmon.features.profiler.callback import ProfilerCallback, ProfileWindow
from mindmon.config import ConfigError, load_yaml
from mindmon.features.profiler.config import ProfilerConfig

REPO = Path(__file__).resolve().parents[3]
OPTIMIZER_OP = "Addcmul"  # AdamW's moment update: runs only in the optimizer step, a fixed number of times per step


def step_clock():
    """A MindFormers callback noting the epoch time (ns) at train begin and at each step end."""
    from mindformers.pynative.callback import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends = {}

        def on_train_begin(self, args, state, **kwargs):
            self.ends[state.global_step] = time.time_ns()

        def on_step_end(self, args, state, **kwargs):
            self.ends[state.global_step] = time.time_ns()

    return StepClock()


def train_with(config, callbacks=(), model=None):
    from mindformers.pynative.trainer import Trainer

    trainer = Trainer(config=copy.deepcopy(config), model=model or make_model(), train_dataset=make_data(config),
                      callbacks=list(callbacks))
    trainer.train()
    return trainer


def trace_dirs(rank_dir):
    return sorted(glob.glob(os.path.join(str(rank_dir), "*_ascend_ms")))


def operators(trace_dir):
    with open(os.path.join(trace_dir, "ASCEND_PROFILER_OUTPUT", "trace_view.json"), encoding="utf-8") as handle:
        return [event for event in json.load(handle) if event.get("ph") == "X"]


def ops_per_step(events, ends):
    """{global step: Counter of operator type}; step N is the time after step N-1 ended, up to its end.
    An operator outside every step of the run lands under None."""
    steps = sorted(ends)
    out = {}
    for event in events:
        at = float(event["ts"]) * 1000.0  # microseconds -> ns
        step = next((s for prev, s in zip(steps, steps[1:]) if ends[prev] < at <= ends[s]), None)
        out.setdefault(step, Counter())[event["name"].split("/")[-1].split("-op")[0]] += 1
    return out


# --- the profiled window on a fresh and on a resumed run -------------------------------------------

@pytest.fixture(scope="module")
def fresh_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    config = trainer_config(out / "monitor", steps=5, global_batch_size=4, profiler={
        "enable_profiling": True, "start_step": 3, "end_step": 4, "output_path": str(out / "prof"),
        "profile_cpu": True, "with_stack": False})
    clock = step_clock()
    trainer = train_with(config, [clock])
    return out, clock, trainer


def test_trace_holds_operators_of_steps_3_and_4_only(fresh_run):
    out, clock, _ = fresh_run
    (trace,) = trace_dirs(out / "prof" / "rank_0")
    by_step = ops_per_step(operators(trace), clock.ends)
    assert set(by_step) == {3, 4}, {k: sum(v.values()) for k, v in by_step.items()}
    # Same work in both steps (2 micro-steps, one update), so the same optimizer op count.
    assert by_step[3][OPTIMIZER_OP] == by_step[4][OPTIMIZER_OP] > 0
    assert by_step[3]["MatMul"] > 0 and by_step[4]["MatMul"] > 0


def test_one_log_line_says_where_the_trace_is(fresh_run):
    out = fresh_run[0]
    (trace,) = trace_dirs(out / "prof" / "rank_0")
    lines = [line for line in mindformers_log().splitlines() if str(out / "prof") in line and "written to" in line]
    assert len(lines) == 1
    assert f"mindmon: profiler: steps 3-4 written to {trace}; open {trace}/ASCEND_PROFILER_OUTPUT/trace_view.json" in lines[0]
    assert f"mindmon profile-summary {trace}" in lines[0]


def test_profile_summary_totals_match_the_trace(fresh_run, capsys):
    from mindmon.cli import main

    out = fresh_run[0]
    (trace,) = trace_dirs(out / "prof" / "rank_0")
    assert main(["profile-summary", str(out / "prof"), "--by", "name", "--top", "1000"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == trace
    rows = {parts[0]: (int(parts[1]), float(parts[2])) for parts in (line.split() for line in printed[3:])}
    # Independently: calls and summed durations per operator name from trace_view.json (durations in us).
    calls, total_us = Counter(), Counter()
    for event in operators(trace):
        if event.get("args", {}).get("type") == "HostCpuOps":
            calls[event["name"]] += 1
            total_us[event["name"]] += float(event["dur"])
    assert {name: c for name, (c, _) in rows.items()} == dict(calls)
    for name, (_, total_ms) in rows.items():
        # MindSpore's table gives each operator's total in ms to 2 decimals (seen: 2359.62 for 2359.624174)
        assert total_ms == pytest.approx(total_us[name] / 1000.0, abs=5e-3), name
    totals = [total for _, total in rows.values()]
    assert totals == sorted(totals, reverse=True)


def test_profile_summary_by_type_top_3(fresh_run, capsys):
    from mindmon.cli import main

    out = fresh_run[0]
    (trace,) = trace_dirs(out / "prof" / "rank_0")
    assert main(["profile-summary", trace, "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    with open(glob.glob(os.path.join(trace, "FRAMEWORK", "cpu_op_detail_info_*.csv"))[0], newline="") as handle:
        per_type = Counter()
        for row in csv.DictReader(handle):
            per_type[row["op_type"]] += float(row["op_total_time(ms)"])
    expected = [name for name, _ in sorted(per_type.items(), key=lambda kv: (-kv[1], kv[0]))[:3]]
    assert [line.split()[0] for line in lines[3:]] == expected
    assert f"top 3 of {len(per_type)} operator types" in lines[1]


def test_profile_summary_without_a_trace_fails_clearly(tmp_path, capsys):
    from mindmon.cli import main

    assert main(["profile-summary", str(tmp_path)]) == 1
    assert "cpu_op_detail_info_*.csv" in capsys.readouterr().err


def test_resumed_run_profiles_the_configured_global_steps(tmp_path):
    """Train 2 steps and save; resume from the checkpoint to step 5 with the window 4-5. Counting
    from loop start (as upstream does) would put the window on global steps 6-7, past the run."""
    first = trainer_config(tmp_path / "monitor", steps=2, global_batch_size=4)
    first["checkpoint"] = {"enable_save": True, "save_path": str(tmp_path / "ckpt"), "save_interleaved_steps": 2}
    train_with(first)
    resumed = trainer_config(tmp_path / "monitor", steps=5, global_batch_size=4, profiler={
        "enable_profiling": True, "start_step": 4, "end_step": 5, "output_path": str(tmp_path / "prof")})
    resumed["checkpoint"] = {"enable_save": False, "load_path": str(tmp_path / "ckpt")}
    clock = step_clock()
    train_with(resumed, [clock])
    assert min(clock.ends) == 2  # the Trainer's state at train begin: the loaded global step
    (trace,) = trace_dirs(tmp_path / "prof" / "rank_0")
    by_step = ops_per_step(operators(trace), clock.ends)
    assert set(by_step) == {4, 5}
    assert by_step[4][OPTIMIZER_OP] == by_step[5][OPTIMIZER_OP] > 0


# --- off, other ranks, bad config ----------------------------------------------------------------

def test_disabled_profiler_registers_nothing_and_writes_nothing(tmp_path):
    config = trainer_config(tmp_path / "monitor", steps=2, global_batch_size=4, profiler={
        "enable_profiling": False, "start_step": 1, "end_step": 2, "output_path": str(tmp_path / "prof")})
    trainer = train_with(config)
    assert not any(isinstance(c, ProfilerCallback) for c in trainer.callback_handler.callbacks)
    assert not (tmp_path / "prof").exists()


@pytest.mark.parametrize("ranks, built", [([1, 2], False), ([0, 1], True), (None, True)])
def test_only_selected_ranks_profile(tmp_path, ranks, built):
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, profiler={"enable_profiling": True, "profiler_rank": ranks,
                                                 "output_path": str(tmp_path / "prof")})
    trainer = Trainer(config=config, model=make_model(), train_dataset=make_data(config))
    assert any(isinstance(c, ProfilerCallback) for c in trainer.callback_handler.callbacks) == built


@pytest.mark.parametrize("section, key", BAD_PROFILER_SECTIONS)
def test_bad_profiler_section_stops_the_trainer_before_step_1(tmp_path, section, key):
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, profiler={"enable_profiling": True, **section})
    with pytest.raises(ConfigError) as error:
        Trainer(config=config, model=make_model(), train_dataset=make_data(config))
    assert key in str(error.value)
    if "start_step" in section and "end_step" not in section:
        assert "missing" in str(error.value)


# --- the callback around plain MindSpore ops ----------------------------------------------------

@pytest.mark.parametrize("start, end, done, expected", [
    (3, 4, 0, ProfileWindow(3, 4, skip_first=1, warmup=1)),
    (1, 2, 0, ProfileWindow(1, 2, skip_first=0, warmup=0)),
    (105, 107, 100, ProfileWindow(105, 107, skip_first=3, warmup=1)),
    (101, 101, 100, ProfileWindow(101, 101, skip_first=0, warmup=0)),
    (98, 103, 100, ProfileWindow(101, 103, skip_first=0, warmup=0)),  # resumed inside the window
    (90, 100, 100, None),                                              # resumed after it
])
def test_window_in_schedule_steps(start, end, done, expected):
    """Schedule step 0 is global step done+1, so the first recorded step is skip_first+warmup later."""
    window = ProfileWindow.of(start, end, done)
    assert window == expected
    if window is not None:
        assert done + 1 + window.skip_first + window.warmup == window.first


def test_callback_resumed_at_step_100_records_global_steps_105_106(tmp_path):
    """The callback driven as a plain loop would, with a state whose global step starts at 100; step
    s runs s-100 forward/backward passes of a real MindSpore Dense layer, so each recorded step
    has its own operator count."""
    import mindspore as ms
    from mindspore import nn

    net = nn.Dense(4, 4)
    optimizer = nn.SGD(net.trainable_params(), 0.1)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, optimizer.parameters)
    config = ProfilerConfig.parse("profiler", {"enable_profiling": True, "start_step": 105, "end_step": 106,
                                   "output_path": str(tmp_path)})
    callback = ProfilerCallback(config)
    state = SimpleNamespace(global_step=100)
    ends = {100: time.time_ns()}
    callback.on_train_begin(None, state)
    for _ in range(8):
        callback.on_step_begin(None, state)
        for _ in range(state.global_step + 1 - 100):
            _, grads = grad_fn(ms.Tensor(np.ones((2, 4), np.float32)))
        optimizer(grads)
        state.global_step += 1
        ends[state.global_step] = time.time_ns()
        callback.on_step_end(None, state)
    callback.on_train_end(None, state)
    (trace,) = trace_dirs(tmp_path / "rank_0")
    by_step = ops_per_step(operators(trace), ends)
    assert set(by_step) == {105, 106}
    # One MatMul forward and one backward (weight gradient) per pass: 5 passes in step 105, 6 in 106.
    assert (by_step[105]["MatMul"], by_step[106]["MatMul"]) == (10, 12)


@pytest.mark.parametrize("name, level, memory, stack, mstx", [
    ("profiler_level0.yaml", "Level0", False, False, False),
    ("profiler_level1.yaml", "Level1", False, False, True),
    ("profiler_level2.yaml", "Level2", True, True, False),
])
def test_scenario_reaches_mindspore_as_configured(tmp_path, caplog, name, level, memory, stack, mstx):
    """What MindSpore's profiler context holds once the callback has built the profile."""
    from mindspore.profiler import ProfilerActivity

    config = ProfilerConfig.parse("profiler", {**load_yaml(str(REPO / "configs" / name))["profiler"], "output_path": str(tmp_path)})
    callback = ProfilerCallback(config)
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        callback.on_train_begin(None, SimpleNamespace(global_step=0))
    context = callback._profile._prof_context
    try:
        assert (context.profiler_level.value, context.profile_memory, context.with_stack, context.mstx) == \
            (level, memory, stack, mstx)
        assert context.activities == [ProfilerActivity.CPU]
        assert [r.message for r in caplog.records if "no NPU here" in r.message] == [
            "mindmon: profiler: no NPU here (device_target CPU); profiling the host CPU operators"
            + ("; profile_cpu: False is ignored" if name == "profiler_level0.yaml" else "")
            + ("; mstx step markers need an NPU and are not recorded" if mstx else "")]
    finally:
        callback.on_train_end(None, SimpleNamespace(global_step=0))
    assert trace_dirs(tmp_path / "rank_0") == []  # the window was never reached


@pytest.mark.parametrize("mstx, runs_as", [(True, "LevelNone"), (False, "Level0")])
def test_level_outside_0_1_2_is_level_none_with_a_warning(tmp_path, caplog, mstx, runs_as):
    """Mapped to LevelNone as documented; MindSpore 2.9 keeps LevelNone only with mstx on."""
    config = ProfilerConfig.parse("profiler", {"enable_profiling": True, "start_step": 3, "end_step": 3, "profiler_level": 7,
                                   "mstx": mstx, "output_path": str(tmp_path)})
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        callback = ProfilerCallback(config)
        callback.on_train_begin(None, SimpleNamespace(global_step=0))
    try:
        assert callback._profile._prof_context.profiler_level.value == runs_as
        assert any("profiler.profiler_level: got 7" in r.message and "maps to LevelNone" in r.message
                   for r in caplog.records)
    finally:
        callback.on_train_end(None, SimpleNamespace(global_step=0))


def test_unusable_output_path_is_a_config_error_before_step_1(tmp_path):
    from mindmon.config import ConfigError

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    config = ProfilerConfig.parse("profiler", {"enable_profiling": True, "output_path": str(blocker)})
    callback = ProfilerCallback(config)
    with pytest.raises(ConfigError, match=r"^profiler\.output_path: got .*a_file.*cannot write"):
        callback.on_train_begin(None, SimpleNamespace(global_step=0))


def test_a_profiler_that_fails_to_start_is_logged_and_training_goes_on(tmp_path, caplog):
    config = ProfilerConfig.parse("profiler", {"enable_profiling": True, "output_path": str(tmp_path / "prof")})
    callback = ProfilerCallback(config)
    callback._start = lambda: (_ for _ in ()).throw(RuntimeError("no profiler here"))
    state = SimpleNamespace(global_step=0)
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        callback.on_train_begin(None, state)
        for _ in range(2):
            callback.on_step_begin(None, state)
            state.global_step += 1
            callback.on_step_end(None, state)
        callback.on_train_end(None, state)
    assert [r.message for r in caplog.records] == [
        "mindmon: profiler could not start and is switched off; training goes on"]


# --- the three shipped scenarios through `mindmon demo` -----------------------------------------

@pytest.fixture(scope="module")
def scenario_runs(tmp_path_factory):
    """Each configs/profiler_level*.yaml through `mindmon demo`, its relative output_path resolved in
    a temp working directory; the three run side by side."""
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    runs = {}
    for level in (0, 1, 2):
        cwd = tmp_path_factory.mktemp(f"level{level}")
        config = REPO / "configs" / f"profiler_level{level}.yaml"
        steps = load_yaml(str(config))["profiler"]["end_step"]
        process = subprocess.Popen(
            [sys.executable, "-m", "mindmon.cli", "demo", "--steps", str(steps), "--output", str(cwd / "out"),
             "--config", str(config)], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        runs[level] = (cwd, process)
    results = {}
    for level, (cwd, process) in runs.items():
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        results[level] = cwd
    return results


@pytest.mark.parametrize("level, first, last", [(0, 3, 5), (1, 3, 5), (2, 3, 4)])
def test_scenario_writes_a_trace_of_its_window(scenario_runs, level, first, last):
    cwd = scenario_runs[level]
    (trace,) = trace_dirs(cwd / "out" / "profile" / "rank_0")  # `mindmon demo --output` keeps it all together
    assert operators(trace)
    log = (cwd / "out" / "log" / "rank_0" / "info.log").read_text()
    assert log.count(f"mindmon: profiler: steps {first}-{last} written to {trace}") == 1
    assert log.count("mindmon: profiler: no NPU here") == 1
    assert "not collected" not in log
    memory = glob.glob(os.path.join(trace, "FRAMEWORK", "cpu_ms_memory_record_*.txt"))
    assert bool(memory) == (level == 2)  # profile_memory is on in scenario C only
