"""Run events from real runs, through the wiring every front door shares (the alert sink's own start, end
and uncaught-exception hook; the peer watchdog's lost ranks), into a real PostgreSQL: a run that finishes
says started and finished; one whose exception nobody catches says started and crashed with the exception's
last line. (A node SIGKILLed under another's launcher, and the lost ranks reaching the recipients once:
tests/parallel/test_two_nodes.py.)"""
import os
import subprocess
import sys

from tests.features.alerts.test_alerts_lifecycle_events import select
from tests.support import HERE, REPO



def _run(tmp_path, url, table, mode):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, os.path.join(HERE, "lifecycle_worker.py"), str(tmp_path / "out"), url, table,
                           mode], env=env, capture_output=True, text=True, timeout=300)


def _events(url, table):
    return [(r["kind"], r["rank"], r["step"], r["message"]) for r in select(url, f"SELECT * FROM {table} ORDER BY id")]


def test_a_finished_run_says_started_and_finished(tmp_path, postgres_url):
    url = postgres_url.render_as_string(hide_password=False)
    table = "lifecycle_finish"
    result = _run(tmp_path, url, table, "finish")
    assert result.returncode == 0, result.stderr[-3000:]
    events = _events(url, table)
    assert [(kind, rank, step) for kind, rank, step, _ in events] == [("started", 0, 0), ("finished", 0, 4)]
    assert events[1][3] == "run finished on rank 0 after step 4 (completed)"


def test_an_uncaught_exception_says_crashed_with_its_last_line(tmp_path, postgres_url):
    url = postgres_url.render_as_string(hide_password=False)
    table = "lifecycle_raise"
    result = _run(tmp_path, url, table, "raise")
    assert result.returncode == 1 and "RuntimeError: the data loader failed" in result.stderr
    events = _events(url, table)
    assert [kind for kind, _, _, _ in events] == ["started", "crashed"]
    assert events[1][3].startswith("run crashed on rank 0 at step ") and events[1][3].endswith("shard 7 is unreadable")
