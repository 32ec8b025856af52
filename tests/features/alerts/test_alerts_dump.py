"""anomaly.json under a storm: after every step the file holds exactly the anomalies of the steps
so far, and a process killed (SIGKILL) at any instant leaves a file that parses, of whole steps."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np

from mindmon.features.alerts import AlertConfig, AlertSink
from mindmon.features.alerts.dump import SPARE_FILE, dump_path
from mindmon.core.engine import RunInfo
from tests.support.alert_dump_worker import STATISTICS, step_records
from tests.support import HERE

RULE = {"rule_name": "AnomalyNan", "args": {"threshold": 0.0}, "kinds": ["grad_reduced"],
        "statistics": list(STATISTICS)}


def expected_values(steps, parameters):
    """Every value the worker's records carry at these steps, computed apart from the records."""
    p, s = np.meshgrid(np.arange(parameters), np.arange(len(STATISTICS)), indexing="ij")
    return sorted(float(v) for step in steps for v in (step + p + s / 10).ravel())


def check_whole_steps(path, parameters, values=True):
    """The steps in the file are 1..m (the YAML route's 1-based step), each with all its anomalies
    (and, with `values`, exactly their values); returns m."""
    with open(path, encoding="utf-8") as f:
        dump = json.load(f)
    counts = Counter(entry["step"] for entry in dump.values())
    steps = sorted(counts)
    assert steps == list(range(1, len(steps) + 1))
    assert set(counts.values()) <= {parameters * len(STATISTICS)}
    if values:
        assert sorted(entry["value"] for entry in dump.values()) == expected_values(steps, parameters)
    return len(steps)


def test_the_dump_holds_exactly_the_steps_so_far_after_every_step_and_a_resumed_run_appends(tmp_path):
    parameters, config = 50, AlertConfig.parse("monitor.alert", {"rules": [RULE], "dump": True})
    sink = AlertSink(config, str(tmp_path))
    path = dump_path(str(tmp_path), 0)
    for step in range(1, 8):
        sink.write(step_records(step, parameters))
        sink.flush()
        assert check_whole_steps(path, parameters) == step
        sink.flush()                     # nothing new: the file stays as it is
        assert check_whole_steps(path, parameters) == step
    sink.close()
    assert not os.path.exists(os.path.join(os.path.dirname(path), SPARE_FILE))   # the spare is gone at the end
    resumed = AlertSink(config, str(tmp_path))
    resumed.open(RunInfo(rank=0, start_step=7))
    for step in range(8, 11):
        resumed.write(step_records(step, parameters))
        resumed.flush()
        assert check_whole_steps(path, parameters) == step
    resumed.close()
    fresh = AlertSink(config, str(tmp_path))     # a fresh run into the folder starts the file anew
    fresh.open(RunInfo(rank=0))
    fresh.write(step_records(1, parameters))
    fresh.flush()
    assert check_whole_steps(path, parameters) == 1
    fresh.close()


def test_a_process_killed_mid_storm_leaves_a_parseable_dump_of_whole_steps(tmp_path):
    """A real process dumping 6,000 anomalies a step is read while it runs and killed with SIGKILL at
    five random instants; every read and every file left parses and holds whole steps only, at least
    the steps the process had reported flushed."""
    parameters, rng = 1000, random.Random(7)
    for attempt in range(5):
        folder = tmp_path / f"run{attempt}"
        worker = subprocess.Popen([sys.executable, os.path.join(HERE, "alert_dump_worker.py"), str(folder),
                                   str(parameters)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join([HERE] + sys.path)})
        path, reads, reported = dump_path(str(folder), 0), 0, 0
        try:
            while reported < 3:                     # a few steps in
                assert worker.stdout.readline().startswith("step "), "the worker ended early"
                reported += 1
            deadline = time.monotonic() + rng.uniform(0.0, 3.0)
            while time.monotonic() < deadline:      # a reader during the run sees whole steps only
                assert check_whole_steps(path, parameters, values=False) >= 1
                reads += 1
        finally:
            worker.send_signal(signal.SIGKILL)
            rest = worker.communicate()[0]
        reported += rest.count("step ")
        left = check_whole_steps(path, parameters)
        print(f"[dump kill {attempt}] {reads} reads during the run; killed after {reported} flushed steps; "
              f"the file holds {left}")
        assert left >= reported
