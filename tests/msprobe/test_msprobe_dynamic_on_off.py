"""Dynamic on/off (DYNAMIC_MONITOR=True + dynamic_on, collect_times, the file's modification time): the six
documented scenarios, invalid edits, reload_xy, driven by editing config.json between steps of a real run."""
import glob
import json
import logging
import os
import re

import pytest

from tests.support.activations_reference import output_root_for, train
from mindmon.msprobe import TrainerMon

BASE = {"targets": {}, "xy_distribution": True, "wg_distribution": True, "ops": ["norm"], "collect_times": 2,
        "ndigits": 8}
COUNTER = 1   # the root cell's micro-step counter, a forward pre-hook (it also gives the root's input views)


@pytest.fixture
def output_root(tmp_path, monkeypatch):
    return output_root_for(tmp_path, monkeypatch, "True")


class Run:
    """A training run whose config.json is edited after given steps; records which cell hooks are
    attached after every step."""

    def __init__(self, tmp_path, config):
        self.path = tmp_path / "monitor_config.json"
        self.stamp = 1_700_000_000
        self.write(config)
        self.hooks_after = []

    def write(self, config, text=None):
        self.path.write_text(text if text is not None else json.dumps(config))
        self.stamp += 10   # a new modification time, however fast the steps are
        os.utime(self.path, (self.stamp, self.stamp))

    def go(self, steps, edits=None):
        edits = edits or {}

        def between(step):
            # the cells' hooks: forward and pre-hooks, and cell backward hooks (mindmon uses none); the root's
            # pre-hook that counts micro-steps stays for the whole run
            self.hooks_after.append(sum(len(cell._forward_hook) + len(cell._forward_pre_hook) + len(cell._backward_hook)
                                        - COUNTER * (not name) for name, cell in self.monitor.model.cells_and_names()))
            if step in edits:
                edits[step](self)

        train(self._make_monitor, steps, between)
        return self

    def _make_monitor(self):
        self.monitor = TrainerMon(str(self.path), params_have_main_grad=False)
        return self.monitor

    def collected(self, prefix="actv"):
        """{step: header} of the `prefix` files written."""
        out = {}
        root = os.environ["MONITOR_OUTPUT_DIR"]
        for path in glob.glob(os.path.join(root, "*-rank0-*", f"{prefix}_*.csv")):
            match = re.match(rf"{prefix}_(\d+)-\d+\.csv$", os.path.basename(path))
            if match:
                with open(path) as file:
                    out[int(match.group(1))] = file.readline().strip()
        return out


def test_scenario_1_static_mode_ignores_dynamic_on(tmp_path, output_root, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "False")
    run = Run(tmp_path, dict(BASE, dynamic_on=False)).go(3)
    assert sorted(run.collected()) == [0, 1]           # from step 0, collect_times = 2
    assert run.hooks_after == [7, 0, 0]                # detached once collect_times is reached
    assert json.loads(run.path.read_text())["dynamic_on"] is False


def test_scenario_2_dynamic_off_at_start_collects_nothing_and_hooks_nothing(tmp_path, output_root):
    run = Run(tmp_path, dict(BASE, dynamic_on=False)).go(3)
    assert run.collected() == {} and run.hooks_after == [0, 0, 0]


def test_scenario_3_and_6_on_at_start_stops_after_collect_times_writes_false_and_restarts(tmp_path, output_root):
    config = dict(BASE, dynamic_on=True, module_ranks=[0], eps=1e-6, squash_name=False)
    restart = dict(config, dynamic_on=True, ops=["max"])
    # The file is checked at each step's end: an edit made during step s is seen at its end and
    # applies from step s + 1. Here it is edited during step 4.
    run = Run(tmp_path, config).go(8, {3: lambda r: r.write(restart)})
    # On at the first check (end of step 0): steps 1 and 2, then off and written back; restarted at the
    # end of step 4: steps 5 and 6 with the new ops.
    assert sorted(run.collected()) == [1, 2, 5, 6]
    assert run.collected()[5].endswith(",max,shape,dtype") and run.collected()[1].endswith(",norm,shape,dtype")
    assert run.hooks_after == [7, 7, 0, 0, 7, 7, 0, 0]
    written = json.loads(run.path.read_text())
    assert written == dict(restart, dynamic_on=False)  # every other key kept
    assert list(written) == list(restart)              # in its order


def test_scenario_4_switched_on_mid_run(tmp_path, output_root):
    run = Run(tmp_path, dict(BASE)).go(6, {2: lambda r: r.write(dict(BASE, dynamic_on=True))})
    assert sorted(run.collected()) == [4, 5] and sorted(run.collected("grad_reduced")) == [4, 5]
    assert run.hooks_after == [0, 0, 0, 7, 7, 0]


def test_scenario_5_edit_while_collecting_restarts_the_count(tmp_path, output_root):
    first = dict(BASE, dynamic_on=True, collect_times=3)
    second = dict(first, ops=["min"], xy_distribution=False)
    early_stop = dict(second, collect_times=0)
    run = Run(tmp_path, first).go(7, {1: lambda r: r.write(second)})
    assert sorted(run.collected()) == [1, 2]                          # old config until the edit
    assert sorted(run.collected("grad_reduced")) == [1, 2, 3, 4, 5]   # new one: 3 more, counted from 0
    assert run.collected("grad_reduced")[3].endswith(",min,shape,dtype")
    assert run.hooks_after == [7, 7, 0, 0, 0, 0, 0]                   # activations off: no cell hooks
    # collect_times edited to 0 stops early: the same run, stopped after 2 of the 3 steps.
    os.environ["MONITOR_OUTPUT_DIR"] = str(tmp_path / "second")
    run = Run(tmp_path, first).go(7, {1: lambda r: r.write(second), 3: lambda r: r.write(early_stop)})
    assert sorted(run.collected("grad_reduced")) == [1, 2, 3, 4]
    assert json.loads(run.path.read_text())["dynamic_on"] is False


def test_invalid_edits_keep_the_running_configuration_and_log_once(tmp_path, output_root, caplog):
    config = dict(BASE, dynamic_on=True, collect_times=5)
    edits = {1: lambda r: r.write(None, text='{"dynamic_on": true, "ops": ["norm"'),
             3: lambda r: r.write(dict(config, ops=["median"]))}
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        run = Run(tmp_path, config).go(6, edits)
    assert sorted(run.collected()) == [1, 2, 3, 4, 5]                # never interrupted
    assert all(h.endswith(",norm,shape,dtype") for h in run.collected().values())
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, errors                                  # each edit once, not once per step
    assert "not valid JSON" in errors[0] and "after step 2" in errors[0]
    assert "ops" in errors[1] and "'median'" in errors[1]


def test_reload_xy_switches_activations_on(tmp_path, output_root, monkeypatch):
    monkeypatch.delenv("DYNAMIC_MONITOR")
    run = Run(tmp_path, dict(BASE, xy_distribution=False, collect_times=10))

    def switch_on(r):
        with pytest.warns(DeprecationWarning, match="reload_xy is deprecated"):
            r.monitor.reload_xy(xy_distribution=True)
    edits = {1: switch_on}
    run.go(4, edits)
    assert sorted(run.collected()) == [2, 3] and sorted(run.collected("grad_reduced")) == [0, 1, 2, 3]
    assert run.hooks_after == [0, 0, 7, 7]
