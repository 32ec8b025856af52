"""A hung rank on 4 real msrun workers (tests/support/hang_worker.py: the demo model, mindmon's own loop): one rank
blocks in Python in its forward, alive, its watchdog's thread beating; rank 0's peer watchdog must name it
and its phase before MindSpore's collective timeout ends the job, every rank must write its threads'
stacks, and the hang must reach rank 0's JSONL and the alert database once. A rank that is slow but
moves is no hang. The fast tests run the watchdogs in plain processes (tests/support/hang_peer.py) whose places
the test sets."""
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from tests.support.hang_worker import SLOW
from tests.support.msrun_launch import HERE, free_port
from tests.support import REPO

pytestmark = pytest.mark.serial   # 4 msrun ranks, one held until the hang is declared

RANKS, ODD, FROM_STEP = 4, 3, 8


class Peers:
    """4 plain processes (tests/support/hang_peer.py), each a rank's watchdog whose place the test sets."""

    def __init__(self, tmp_path, hang_after):
        port, self.tmp_path = free_port(), tmp_path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, REPO]))
        self.processes = [subprocess.Popen(
            [sys.executable, os.path.join(HERE, "hang_peer.py"), str(rank), str(RANKS), str(port), str(hang_after),
             str(tmp_path / "out")], stdin=subprocess.PIPE, stdout=open(tmp_path / f"peer{rank}.log", "w"),
            stderr=subprocess.STDOUT, env=env, text=True) for rank in range(RANKS)]
        assert wait_until(lambda: all("ready" in self.log(rank) for rank in range(RANKS)), 60)

    def log(self, rank):
        return (self.tmp_path / f"peer{rank}.log").read_text()

    def lines(self, rank, text):
        return [line for line in self.log(rank).splitlines() if text in line]

    def tell(self, ranks, command):
        for rank in ranks:
            self.processes[rank].stdin.write(command + "\n")
            self.processes[rank].stdin.flush()

    def end(self):
        for process in self.processes:
            process.kill()
            process.wait()


@pytest.fixture
def peers(tmp_path):
    made = []
    yield lambda hang_after: made.append(Peers(tmp_path, hang_after)) or made[-1]
    for group in made:
        group.end()


def test_a_hang_is_declared_once_ends_when_a_rank_moves_and_the_next_one_is_counted(peers, tmp_path):
    group = peers(3.0)
    group.tell(range(RANKS), "enter 1 forward_backward")
    group.tell((0, 1, 2), "enter 1 reduce")
    stopped = time.time()
    assert wait_until(lambda: all(group.lines(rank, "mindmon: hang:") for rank in range(RANKS)), 10)
    assert 3.0 <= time.time() - stopped < 3.0 + 2.5
    line = group.lines(0, "mindmon: hang:")[0]
    assert re.fullmatch(r"ERROR mindmon: hang: no rank has progressed for 3\.\d s \(hang_after 3\.0 s\); rank 3 is in "
                        r"forward_backward of step 1 since [0-9: -]+, ranks \[0, 1, 2\] in reduce of step 1 since "
                        rf"[0-9: -]+; stacks written to {re.escape(str(tmp_path / 'out'))}/rank_\*/hang_1_stacks\.txt",
                        line), line
    assert group.lines(0, "on_hang") == ["on_hang 1 [3] 1 reduce"]
    group.tell((3,), "enter 1 reduce")   # the stuck rank moves: the hang is over, the watch goes on
    assert wait_until(lambda: group.lines(0, "is over"), 5)
    assert group.lines(0, "is over") == ["WARNING mindmon: hang 1 is over: rank 3 moved on to reduce of step 1"]
    group.tell((1, 2, 3), "enter 2 data")
    group.tell((0,), "enter 1 update")   # rank 0 stuck in its update: ranks 1-3 wait for it between steps
    assert wait_until(lambda: len(group.lines(3, "mindmon: hang:")) == 2, 10)
    assert group.lines(0, "on_hang")[1:] == ["on_hang 2 [0] 2 data"]
    assert "rank 0 is in update of step 1 since " in group.lines(3, "mindmon: hang:")[1]
    time.sleep(1.5)
    for rank in range(RANKS):   # one line per hang on every rank, however many heartbeats it lasted
        assert len(group.lines(rank, "mindmon: hang:")) == 2, group.log(rank)
        for number in (1, 2):
            text = (tmp_path / "out" / f"rank_{rank}" / f"hang_{number}_stacks.txt").read_text()
            assert text.startswith(f"rank {rank}, ") and "Thread 0x" in text and "hang_peer.py" in text


def test_ranks_between_steps_or_finishing_at_different_times_are_no_hang(peers, tmp_path):
    group = peers(3.0)
    group.tell(range(RANKS), "enter 1 forward_backward")
    group.tell(range(RANKS), "enter 2 data")   # all between the same two steps (a checkpoint): however long
    time.sleep(3.0 * 2)
    group.tell((0, 1), "enter 2 reduce")
    time.sleep(2.0)
    group.tell((2, 3), "enter 2 monitor")   # ranks 2 and 3 finish, 0 and 1 still in the all-reduce ...
    group.tell((2, 3), "close")
    time.sleep(2.0)                          # ... over hang_after since their own last move, not since 2's and 3's
    group.tell((0, 1), "enter 2 monitor")
    group.tell((1, 0), "close")
    for process in group.processes:
        assert process.wait(timeout=10) == 0
    for rank in range(RANKS):
        assert group.lines(rank, "hang") == [], group.log(rank)
    assert not (tmp_path / "out").exists()


def launch(run_dir, steps, mode, hang_after, database_url="none"):
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]))
    command = [os.path.join(bin_dir, "msrun"), f"--worker_num={RANKS}", f"--local_worker_num={RANKS}",
               f"--master_port={free_port()}", f"--log_dir={run_dir / 'logs'}", "--join=True",
               os.path.join(HERE, "hang_worker.py"), str(run_dir / "out"), str(steps), mode, str(ODD),
               str(FROM_STEP), str(hang_after), database_url]
    return subprocess.Popen(command, env=env, cwd=run_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def end(launcher):
    """The launcher's process group and each of its workers' (msrun starts each in a session of its own)."""
    if launcher.poll() is None:
        with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as handle:
            children = [int(pid) for pid in handle.read().split()]
        for pid in [launcher.pid] + children:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    launcher.communicate()


def log(run_dir, rank):
    path = run_dir / "logs" / f"worker_{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def hang_lines(run_dir, rank):
    return [line for line in log(run_dir, rank).splitlines() if "mindmon: hang:" in line]


def wait_until(condition, seconds, launcher=None):
    deadline = time.time() + seconds
    while time.time() < deadline:
        found = condition()
        if found or (launcher is not None and launcher.poll() is not None):
            return found
        time.sleep(0.1)
    return condition()


def step_seconds(run_dir, rank):
    return {int(step): float(seconds) for step, seconds in re.findall(r"^step (\d+) ([0-9.]+)$", log(run_dir, rank),
                                                                       re.M)}


def hang_rows(url):
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return [dict(row._mapping) for row in connection.execute(text(
                "SELECT rank, step, kind, tag_name, statistic, value, rule_name, message FROM hang_alerts"))]
    finally:
        engine.dispose()


@pytest.fixture
def database(postgres_url):
    """The session's PostgreSQL with no `hang_alerts` table left by an earlier test."""
    from sqlalchemy import create_engine, text

    url = postgres_url.render_as_string(hide_password=False)
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("DROP TABLE IF EXISTS hang_alerts"))
    engine.dispose()
    return url


MINDSPORE_END = ("Kill this process with SIGTERM", "ReduceScatter", "Launch kernel failed")


def test_a_rank_blocked_in_its_forward_is_named_with_its_phase_and_stack_before_mindspore_ends_the_job(
        tmp_path, database):
    launcher = launch(tmp_path, 100_000, "block", "default", database)
    try:
        blocked = wait_until(lambda: re.search(r"blocking at ([0-9.]+)", log(tmp_path, ODD)), 300, launcher)
        assert blocked, (launcher.poll(), log(tmp_path, ODD)[-3000:])
        blocked_at = float(blocked.group(1))
        assert wait_until(lambda: any(hang_lines(tmp_path, rank) for rank in range(RANKS)), 40, launcher)
        named_after = time.time() - blocked_at
        assert launcher.poll() is None   # the job still runs: MindSpore has not ended it
        for rank in range(RANKS):
            assert wait_until(lambda: hang_lines(tmp_path, rank), 3), log(tmp_path, rank)[-2000:]
        stacks = {rank: tmp_path / "out" / f"rank_{rank}" / "hang_1_stacks.txt" for rank in range(RANKS)}
        assert wait_until(lambda: all(path.exists() for path in stacks.values()), 3)
        rows = wait_until(lambda: hang_rows(database) if _table_exists(database) else [], 20)
        print(f"hang named {named_after:.1f} s after rank {ODD} blocked")
        texts = {rank: path.read_text() for rank, path in stacks.items()}
        wait_until(lambda: launcher.poll() is not None, 120)   # MindSpore's own end of the job, for the order
    finally:
        end(launcher)

    steps = step_seconds(tmp_path, 0)
    assert sorted(steps) == list(range(1, FROM_STEP))
    # The derived hang_after: 4 median step times, at least 10 s (rank 0's watchdog times the steps from
    # its phases, the worker around its calls: a few per cent apart at most)
    want = max(10.0, 4 * statistics.median(steps.values()))
    line = hang_lines(tmp_path, 0)[0]
    pattern = (rf"mindmon: hang: no rank has progressed for ([0-9.]+) s \(hang_after ([0-9.]+) s\); rank {ODD} is in "
               rf"forward_backward of step {FROM_STEP} since [0-9: -]+, ranks \[0, 1, 2\] in reduce of step "
               rf"{FROM_STEP} since [0-9: -]+; stacks written to {re.escape(str(tmp_path / 'out'))}/rank_\*/"
               rf"hang_1_stacks\.txt$")
    found = re.search(pattern, line)
    assert found, line
    hang_after = float(found.group(2))
    assert hang_after == pytest.approx(want, rel=0.1, abs=0.05), (hang_after, steps)
    assert hang_after <= float(found.group(1)) < hang_after + 1.0
    # From the block: the others' forward before the stall begins (less than a step), then hang_after, then
    # at most half a second to rank 0's next judgement.
    assert hang_after <= named_after < hang_after + max(steps.values()) + 1.0, (named_after, steps)
    for rank in range(RANKS):
        lines = hang_lines(tmp_path, rank)
        assert len(lines) == 1 and lines[0].endswith(found.group(0)), lines
        text = log(tmp_path, rank)
        ends = [text.index(mark) for mark in MINDSPORE_END if mark in text]
        assert not ends or text.index("mindmon: hang:") < min(ends)
        assert texts[rank].startswith(f"rank {rank}, ") and found.group(0) in texts[rank].splitlines()[0]
        assert "Thread 0x" in texts[rank] and "mindmon/parallel/watchdog.py" in texts[rank]
    blocking = re.search(r'File "[^"]*hang_worker\.py", line \d+ in block_forever', texts[ODD])
    assert blocking, texts[ODD]
    for rank in range(ODD):   # the others wait in the all-reduce, under the train step; none in block_forever
        assert "block_forever" not in texts[rank] and "mindmon/loop/step.py" in texts[rank], texts[rank]
    from mindmon.formats import jsonl

    for rank in range(RANKS):   # rank 0 writes the hang to its JSONL at once, while its step never ends
        hangs = [r for r in jsonl.read_records(str(tmp_path / "out" / f"rank_{rank}" / "metrics.jsonl"))
                 if r.kind == "hang"]
        assert [(r.step, r.name, r.value) for r in hangs] == ([] if rank else [
            (FROM_STEP, f"rank {ODD} in forward_backward of step {FROM_STEP}",
             pytest.approx(float(found.group(1)), abs=0.05))]), hangs
    assert rows == [{"rank": ODD, "step": FROM_STEP, "kind": "hang", "tag_name": "hang", "statistic": "seconds",
                     "value": pytest.approx(float(found.group(1)), abs=0.05), "rule_name": "hang",
                     "message": found.group(0)}]


def _table_exists(url):
    from sqlalchemy import create_engine, inspect

    engine = create_engine(url)
    try:
        return inspect(engine).has_table("hang_alerts")
    finally:
        engine.dispose()


def test_a_slow_rank_that_moves_is_no_hang(tmp_path):
    hang_after, steps = 9.0, FROM_STEP + 3
    launcher = launch(tmp_path, steps, "slow", hang_after)
    try:
        output = launcher.communicate(timeout=400)[0]
    finally:
        end(launcher)
    assert launcher.returncode == 0, output[-3000:]
    for rank in range(RANKS):
        assert "trained" in log(tmp_path, rank).splitlines(), log(tmp_path, rank)[-3000:]
        assert hang_lines(tmp_path, rank) == []
        assert not (tmp_path / "out" / f"rank_{rank}" / "hang_1_stacks.txt").exists()
    seconds = step_seconds(tmp_path, ODD)
    slow = [seconds[step] for step in range(FROM_STEP, steps + 1)]
    # Each slow step lasted longer than hang_after (a judge by steps, or by rank 0's wait in its all-reduce,
    # would have fired), each of the slow rank's phases less.
    assert all(hang_after < 2 * SLOW < s for s in slow), seconds
