"""Two nodes in miniature: two `msrun` launchers on this machine (`--worker_num=4 --local_worker_num=2`,
node ranks 0 and 1, master 127.0.0.1, one port), each starting 2 real workers (tests/support/two_node_worker.py)
that join one `mccl` group of 4 ranks.

Both launchers see the master address as local, so both start MindSpore's scheduler; node 1's fails to
bind the port node 0's holds ("Failed to init the tcp server") and its launcher exits non-zero although
its workers finish: the tests start node 0 first, wait for its scheduler's port, and judge the run by
the workers. msrun starts each worker in a process group of its own, so a SIGKILL of a launcher's
process group leaves its workers running: losing a node means killing the launcher and its workers."""
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support.msrun_launch import HERE, free_port
from mindmon.formats import jsonl
from tests.support.two_node_worker import K, batch
from tests.support import REPO

pytestmark = pytest.mark.serial   # two msrun launchers of 2 ranks each and MindSpore's heartbeat timeout

RANKS = 4


def _launcher(node, port, run_dir, steps):
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]))
    command = [os.path.join(bin_dir, "msrun"), f"--worker_num={RANKS}", "--local_worker_num=2", f"--node_rank={node}",
               "--master_addr=127.0.0.1", f"--master_port={port}", f"--log_dir={run_dir / f'node{node}'}",
               "--join=True", os.path.join(HERE, "two_node_worker.py"), str(run_dir / "out"), str(steps),
               str(run_dir / "alerts.db")]
    return subprocess.Popen(command, env=env, cwd=run_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _wait_for_port(port, launcher):
    while launcher.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(launcher.stdout.read()[-3000:])


def launch_two_nodes(run_dir, steps):
    port = free_port()
    first = _launcher(0, port, run_dir, steps)
    _wait_for_port(port, first)   # node 0's scheduler holds the port before node 1's tries
    return first, _launcher(1, port, run_dir, steps)


def _records(run_dir, rank):
    return jsonl.read_records(str(run_dir / "out" / f"rank_{rank}" / "metrics.jsonl"))


def _log(run_dir, node, name):
    return (run_dir / f"node{node}" / name).read_text(errors="replace")


def test_two_nodes_write_every_rank_reduce_over_four_and_deliver_every_alert(tmp_path):
    steps = 4
    nodes = launch_two_nodes(tmp_path, steps)
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert nodes[0].returncode == 0, outputs[0][-3000:]
    assert nodes[1].returncode != 0 and "Failed to init the tcp server" in _log(tmp_path, 1, "scheduler.log")
    for rank in range(RANKS):
        assert "trained" in _log(tmp_path, rank // 2, f"worker_{rank}.log").splitlines()
        assert _watchdog_lines(tmp_path, rank) == []   # ranks that end, at whatever moment, are not lost
    records = {rank: _records(tmp_path, rank) for rank in range(RANKS)}
    weight = np.full((3, 1), 0.25)
    for rank in range(RANKS):   # step 1's local losses, from the initial weight, by numpy
        x, y = batch(rank, 1)
        want = [float(np.mean((x[k * 2:(k + 1) * 2] @ weight - y[k * 2:(k + 1) * 2]) ** 2)) for k in range(K)]
        got = [r.value for r in records[rank] if r.kind == "local_loss" and r.step == 1]
        np.testing.assert_allclose(got, want, rtol=1e-6)
    for step in range(1, steps + 1):   # device_loss: the mean over all 4 ranks' micro-batch losses, on every rank
        local = [r.value for rank in range(RANKS) for r in records[rank] if r.kind == "local_loss" and r.step == step]
        assert len(local) == RANKS * K
        for rank in range(RANKS):
            device, = [r.value for r in records[rank] if r.kind == "device_loss" and r.step == step]
            assert device == pytest.approx(np.mean(local), rel=1e-6)
    with sqlite3.connect(tmp_path / "alerts.db") as db:
        rows = db.execute("SELECT rank, step, tag_name FROM mindmon_anomalies").fetchall()
    assert sorted(rows) == [(rank, step, "device_loss/loss") for rank in range(RANKS) for step in range(1, steps + 1)]


def kill_node(launcher):
    """SIGKILL to the launcher's process group and to the group of each of its children (its workers)."""
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as handle:
        children = [int(pid) for pid in handle.read().split()]
    for pid in [launcher.pid] + children:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:   # a child that has already exited (node 1's scheduler)
            pass
    launcher.wait()


def _steps_written(run_dir, rank):
    path = run_dir / "out" / f"rank_{rank}" / "metrics.jsonl"
    return {r.step for r in jsonl.read_records(str(path))} if path.exists() else set()


def _watchdog_lines(run_dir, rank):
    text = _log(run_dir, rank // 2, f"worker_{rank}.log")
    return [line for line in text.splitlines() if "stopped answering" in line]


def _named_after(run_dir, rank, killed_at, deadline=120):
    """Seconds from the kill to the watchdog's first line in the surviving rank's log (None: none came)."""
    while time.time() < killed_at + deadline:
        if _watchdog_lines(run_dir, rank):
            return time.time() - killed_at
        time.sleep(0.1)
    return None


def _whole_steps(run_dir, rank):
    """Every step the rank wrote is whole: K local losses, the device loss and norm; the last step."""
    text = (run_dir / "out" / f"rank_{rank}" / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    records = [r for r in jsonl.read_records(str(run_dir / "out" / f"rank_{rank}" / "metrics.jsonl"))
               if r.kind != "rank_lost"]   # rank 0's finding, written when it is made (below)
    steps = sorted({r.step for r in records})
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= 3
    for step in steps:
        kinds = sorted(r.kind for r in records if r.step == step)
        assert kinds == ["device_loss", "device_norm"] + ["local_loss"] * K, (rank, step, kinds)
    return steps[-1]


def _lose(run_dir, lost, survivors):
    """Both nodes past step 3, then the launcher and workers of `lost` killed, and the watchdog's lines
    waited for in the surviving ranks' logs."""
    deadline = time.time() + 240
    while time.time() < deadline and not all(3 in _steps_written(run_dir, rank) for rank in range(RANKS)):
        time.sleep(0.5)
    kill_node(lost)
    killed_at = time.time()
    for rank in survivors:
        print(f"rank {rank}: the watchdog's line {_named_after(run_dir, rank, killed_at)} s after the kill")


def _last_seen(line):
    """The step(s) a watchdog line gives: `last seen at step 17` or, when the ranks' last heartbeats
    carried different steps, `last seen at steps [17, 18]`."""
    found = re.search(r"last seen at steps? \[?([0-9, ]+)\]?\)", line)
    return [int(step) for step in found.group(1).split(",")]


def _seen(steps):
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"


def test_a_lost_node_is_named_by_every_survivor_and_ends_the_other_keeping_its_steps(tmp_path):
    first, second = launch_two_nodes(tmp_path, 100_000)
    try:
        _lose(tmp_path, second, (0, 1))
        killed_at = time.time()
        output = first.communicate(timeout=240)[0]
        print(f"node 0 ended {time.time() - killed_at:.1f} s after its workers named the lost ranks")
    finally:
        for launcher in (first, second):
            if launcher.poll() is None:
                kill_node(launcher)
    assert first.returncode != 0, output[-2000:]
    scheduler = _log(tmp_path, 0, "scheduler.log")
    timed_out = {rank for rank in range(RANKS) if f"The node: {rank} is timed out" in scheduler}
    assert timed_out and timed_out <= {2, 3}, timed_out   # MindSpore's: the first lost rank(s) of node 1
    lost_at = max(max(_steps_written(tmp_path, rank)) for rank in (2, 3))
    for rank in (0, 1):
        lines = _watchdog_lines(tmp_path, rank)
        assert len(lines) == 1, lines   # one line, both ranks in it, before MindSpore ended the process
        assert lines[0].endswith(f"[rank {rank}] mindmon: ranks [2, 3] stopped answering (their connections "
                                 f"closed; last seen at {_seen(_last_seen(lines[0]))}); this job cannot go on"), lines
        assert max(_last_seen(lines[0])) <= lost_at   # their last heartbeat's step: at most their last written
        text = _log(tmp_path, 0, f"worker_{rank}.log")
        if "Kill this process with SIGTERM" in text:   # MindSpore's own end of the process came after it
            assert text.index("stopped answering") < text.index("Kill this process with SIGTERM")
        _whole_steps(tmp_path, rank)
    # rank 0's finding reached its JSONL at once and its alert recipients once (the rank_lost run event)
    found = [r for r in jsonl.read_records(str(tmp_path / "out" / "rank_0" / "metrics.jsonl")) if r.kind == "rank_lost"]
    assert sorted(r.name for r in found) == ["rank 2", "rank 3"]
    with sqlite3.connect(tmp_path / "alerts.db") as db:
        rows = db.execute("SELECT rank, kind, message FROM mindmon_anomalies WHERE kind = 'rank_lost'").fetchall()
    assert len(rows) == 1 and rows[0][0] == 2 and "ranks [2, 3] stopped answering" in rows[0][2], rows


def test_losing_the_heartbeat_host_is_named_by_the_other_node(tmp_path):
    first, second = launch_two_nodes(tmp_path, 100_000)
    try:
        _lose(tmp_path, first, (2, 3))
    finally:
        for launcher in (first, second):
            if launcher.poll() is None:
                kill_node(launcher)
    host_at = max(_steps_written(tmp_path, 0))
    for rank in (2, 3):
        lines = _watchdog_lines(tmp_path, rank)
        assert len(lines) == 1, lines
        assert lines[0].endswith(f"[rank {rank}] mindmon: rank 0 (mindmon's heartbeat host) stopped answering (its "
                                 f"connection closed; last seen at {_seen(_last_seen(lines[0]))}); this job cannot "
                                 f"go on (which other ranks were lost with it cannot be told)"), lines
        assert _last_seen(lines[0])[0] <= host_at   # its last answer's step: at most its last written
        _whole_steps(tmp_path, rank)
