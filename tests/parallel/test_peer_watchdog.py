"""mindmon's peer watchdog (mindmon/parallel/watchdog.py) between real processes on real sockets, no
MindSpore: ranks killed with SIGKILL, a rank frozen with SIGSTOP, the host rank killed, and the ends that
must name nobody (every rank closing, a program ending without close). tests/parallel/test_two_nodes.py runs it in
msrun workers blocked in MindSpore's all-reduce."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.msrun_launch import HERE, free_port
from tests.support import REPO

pytestmark = pytest.mark.serial   # processes killed and frozen until the watchdog's silence timeout

WORLD, STEPS = 4, 7


def lost_line(ranks, how):
    return f"ERROR mindmon: {ranks} stopped answering ({how}; last seen at step {STEPS}); this job cannot go on"


class Peers:
    def __init__(self, tmp_path, silence=10.0, host="127.0.0.1", machine_of=lambda rank: []):
        """`machine_of(rank)`: the command prefix that runs the rank on its machine (a network namespace)."""
        self.port, self.tmp_path = free_port(), tmp_path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, REPO]))
        self.processes = []
        for rank in range(WORLD):
            out = open(tmp_path / f"rank{rank}.log", "w")
            self.processes.append(subprocess.Popen(
                machine_of(rank) + [sys.executable, os.path.join(HERE, "watchdog_peer.py"), str(rank), str(WORLD),
                                    host, str(self.port), str(silence), str(STEPS)],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env, text=True))

    def log(self, rank):
        return (self.tmp_path / f"rank{rank}.log").read_text()

    def wait_for(self, rank, text, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline and text not in self.log(rank):
            time.sleep(0.1)
        return text in self.log(rank)

    def all_beating(self):
        """Every rank has written its steps; two heartbeats later rank 0 holds each one's last step."""
        assert all(self.wait_for(rank, f"at step {STEPS}") for rank in range(WORLD))
        time.sleep(2.5)

    def tell(self, rank, command):
        self.processes[rank].stdin.write(command + "\n")
        self.processes[rank].stdin.flush()

    def lines(self, rank):
        return [line for line in self.log(rank).splitlines() if "stopped answering" in line]

    def assert_named(self, survivors, want):
        """Each survivor logs the line `want`, and no second one in the heartbeat after it."""
        for rank in survivors:
            assert self.wait_for(rank, "stopped answering"), self.log(rank)
        time.sleep(1.5)
        for rank in survivors:
            assert self.lines(rank) == [want], self.log(rank)

    def end(self):
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait()


@pytest.fixture
def peers(tmp_path):
    made = []
    yield lambda **kwargs: made.append(Peers(tmp_path, **kwargs)) or made[-1]
    for group in made:
        group.end()


def test_killed_ranks_are_named_together_on_every_survivor(peers):
    group = peers()
    group.all_beating()
    for rank in (2, 3):
        group.processes[rank].kill()
    group.assert_named((0, 1), lost_line("ranks [2, 3]", "their connections closed"))


def test_a_frozen_rank_is_not_lost_while_its_machine_answers_and_is_named_once_killed(peers):
    group = peers(silence=3.0)
    group.all_beating()
    group.processes[1].send_signal(signal.SIGSTOP)   # no heartbeat (as a long call holding the GIL), its kernel answers
    time.sleep(3 * 3.0)
    assert [group.lines(rank) for rank in (0, 2, 3)] == [[], [], []]
    group.processes[1].kill()
    group.assert_named((0, 2, 3), lost_line("rank 1", "its connection closed"))


def test_a_lost_host_is_named_by_the_others(peers):
    group = peers()
    group.all_beating()
    group.processes[0].kill()
    want = (f"ERROR mindmon: rank 0 (mindmon's heartbeat host) stopped answering (its connection closed; last seen "
            f"at step {STEPS}); this job cannot go on (which other ranks were lost with it cannot be told)")
    group.assert_named((1, 2, 3), want)


def test_an_uncaught_exception_loses_its_rank_but_an_end_without_close_does_not(peers):
    group = peers()
    group.all_beating()
    group.tell(3, "exit")      # the program ends normally, never closing: its exit hook says goodbye
    group.tell(2, "raise")     # an uncaught exception: no goodbye, the others must hear of it
    group.tell(1, "close in finally")   # closed on the exception's way out: no goodbye either
    for rank in (1, 2, 3):
        group.processes[rank].wait()
    group.assert_named((0,), lost_line("ranks [1, 2]", "their connections closed"))


def test_ranks_that_close_in_any_order_name_nobody(peers):
    group = peers()
    group.all_beating()
    for rank in (0, 3, 1, 2):   # the host first: the others are told it closed, not lost
        group.tell(rank, "close")
        assert group.wait_for(rank, "closed")
    for rank in range(WORLD):
        assert group.processes[rank].wait(timeout=30) == 0, group.log(rank)
        assert group.lines(rank) == [] and "Traceback" not in group.log(rank), group.log(rank)


def test_a_run_of_one_rank_has_no_watchdog_and_msruns_address_gives_the_port(monkeypatch):
    from mindmon import build_group, parse_sections
    from mindmon.parallel.watchdog import PeerWatchdog, endpoint

    monkeypatch.setenv("MS_SCHED_HOST", "127.0.0.1")
    monkeypatch.setenv("MS_SCHED_PORT", "8118")
    assert endpoint() == ("127.0.0.1", 8119)
    monkeypatch.setenv("MS_SCHED_PORT", "65535")
    assert endpoint() == ("127.0.0.1", 65534)
    group = build_group(parse_sections({"monitor": {"train_state": {"local_loss": True}}}))
    assert group.sinks and group.services == []
    assert not any(isinstance(sink, PeerWatchdog) for sink in group.sinks)
    monkeypatch.delenv("MS_SCHED_HOST")
    assert endpoint() is None


def test_a_taken_port_switches_the_watchdog_off_with_one_line_and_training_goes_on(caplog):
    import logging
    import socket

    from mindmon.core.engine import RunInfo
    from mindmon.parallel.watchdog import PeerWatchdog
    from mindmon.core.progress import DATA, PROGRESS

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        watchdog = PeerWatchdog(0, 2, ("127.0.0.1", port), logging.getLogger("mindmon.test"))
        with caplog.at_level(logging.WARNING, logger="mindmon.test"):
            watchdog.start(RunInfo(0))   # the thread tries the port at once; stop() waits for it
            PROGRESS.enter(6, DATA)     # step 5 written, waiting for step 6's data
            watchdog.stop()
    assert watchdog.step == 5 and watchdog.closed
    assert [r.getMessage() for r in caplog.records] == [
        f"mindmon: the peer watchdog is off: rank 0 cannot listen at 127.0.0.1:{port} (Address already in use)"]


@pytest.fixture
def two_machines():
    """Two network namespaces joined by a veth pair, as two machines (10.231.0.1 and 10.231.0.2), and a
    function that pulls the second one's cable (its end of the link down: nothing answers any more)."""
    tag = f"mm{os.getpid() % 100000}"
    machines, ends = (f"{tag}a", f"{tag}b"), (f"{tag}x", f"{tag}y")

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        for machine in machines:
            ip("netns", "add", machine)
        ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for number, (machine, end) in enumerate(zip(machines, ends), 1):
            ip("link", "set", end, "netns", machine)
            ip("-n", machine, "addr", "add", f"10.231.0.{number}/24", "dev", end)
            ip("-n", machine, "link", "set", end, "up")
            ip("-n", machine, "link", "set", "lo", "up")
        yield machines, lambda: ip("-n", machines[1], "link", "set", ends[1], "down")
    finally:
        for machine in machines:
            subprocess.run(["ip", "netns", "del", machine], capture_output=True)


def test_a_machine_that_stops_answering_is_named_after_the_silence(peers, two_machines):
    machines, pull_cable = two_machines
    group = peers(silence=3.0, host="10.231.0.1",
                  machine_of=lambda rank: ["ip", "netns", "exec", machines[rank == 3]])   # rank 3 alone on B
    group.all_beating()
    pull_cable()
    group.assert_named((0, 1, 2), lost_line("rank 3", "its machine gave no answer for 3 s"))
    assert group.wait_for(3, "stopped answering") and group.lines(3) == [
        f"ERROR mindmon: rank 0 (mindmon's heartbeat host) stopped answering (its machine gave no answer for 3 s; "
        f"last seen at step {STEPS}); this job cannot go on (which other ranks were lost with it cannot be told)"]
