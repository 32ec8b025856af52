"""The peer watchdog of a multi-rank run: names the ranks that stopped answering, while the survivors
wait in a collective that will never complete (docs/multi-rank.md, "A lost node"), and the ranks that
answer but no longer move (docs/multi-rank.md, "A hung rank").

World rank 0 hosts a small TCP server at the master's address (`MS_SCHED_HOST`, port `MS_SCHED_PORT` + 1);
every other rank keeps one connection to it and sends its last written step every second. A rank is
lost when its connection closes without a goodbye (its process died: the kernel closes its sockets)
or when its machine has not answered for `SILENCE` seconds (TCP keepalive and TCP_USER_TIMEOUT: the
machine or the network is gone). Liveness is the kernel's, not the Python thread's: a rank whose
threads are held for a while (a long call that keeps the GIL, a stopped process) is not lost. Rank 0
waits `SETTLE` seconds after the first loss, so the ranks of one node are named together, then logs
one line and answers every survivor's next heartbeat with it. A rank that loses rank 0 says so itself.

Each heartbeat also carries the rank's place in its step (mindmon.core.progress: step, phase, since when).
Rank 0 declares a hang when no rank has moved for `hang_after` seconds: it logs one line
naming the ranks whose (step, phase) differ from the majority's, writes its threads' stacks
(faulthandler), hands the event to `on_hang`, and answers every heartbeat with the line until some rank
moves again; each rank that hears it logs it and writes its own stacks.

Why a thread and sockets of its own: a survivor's main thread is inside MindSpore's all-reduce, which
releases the GIL while it waits, so a daemon thread still runs; no Python handler runs on the main
thread until MindSpore's own heartbeat ends the process about 30 s later. Plain sockets, not
`mindspore.mint.distributed.TCPStore`: the watchdog needs to see a peer's connection close, and its
own waits bounded by timeouts it sets, both of which a key-value store hides.
"""
import atexit
import errno
import faulthandler
import os
import selectors
import socket
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mindmon.core.engine import RunInfo, Service
from mindmon.formats.run_folder import rank_dir
from mindmon.core.progress import DATA, PHASES, PROGRESS, Place

INTERVAL = 1.0    # seconds between a rank's heartbeats
SILENCE = 10.0    # seconds without an answer from a rank's machine (to keepalive probes or data): lost
SETTLE = 2.0      # seconds rank 0 waits after the first loss, for the other ranks of the same node
STARTUP = 120.0   # seconds a rank keeps trying to reach rank 0 before it gives up (the watchdog off)
HANG_FLOOR = 10.0  # seconds: the least derived hang_after
HANG_STEPS = 4.0   # the derived hang_after in median step times (MindSpore's CPU collectives give up after ~30 s)
HANG_MEASURED = 3  # step times rank 0 measures before the derived hang_after holds (the first steps: unwatched)
HANG_WINDOW = 50   # the latest step times the median is taken over
HOST_RANK = 0
_watching: Optional["PeerWatchdog"] = None   # the process's running watchdog


def endpoint() -> Optional[Tuple[str, int]]:
    """(host, port) of the heartbeat server, from msrun's environment; None outside msrun."""
    host, port = os.environ.get("MS_SCHED_HOST"), os.environ.get("MS_SCHED_PORT", "")
    if not host or not port.isdigit():
        return None
    port = int(port)
    return host, port + 1 if port < 65535 else port - 1


def peer_watchdog(logger, hang_after: Optional[float] = None, output_dir: Optional[str] = None,
                  on_hang: Optional[Callable[["Hang"], None]] = None,
                  on_lost: Optional[Callable[[List[int], str], None]] = None) -> Optional["PeerWatchdog"]:
    """This rank's watchdog: None on a run of one rank, or outside msrun. `hang_after`: seconds without
    progress on any rank that make a hang (None: HANG_STEPS median step times, at least HANG_FLOOR);
    `output_dir`: the run's output folder, each rank's stacks go to its `rank_<r>/` (None: to stderr);
    `on_hang`: called on rank 0's watchdog thread with each hang it declares; `on_lost`: called on rank 0's
    watchdog thread with the lost ranks and the line, when it names them."""
    from mindmon.parallel.data_parallel import DataParallel

    world, address = DataParallel(), endpoint()
    if not world.active or address is None:
        return None
    watchdog = PeerWatchdog(world.rank, world.size, address, logger, hang_after=hang_after, output_dir=output_dir,
                            on_hang=on_hang)
    watchdog.on_lost = on_lost
    return watchdog


def ranks_phrase(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {sorted(ranks)}"


def step_phrase(steps: Sequence[int]) -> str:
    """The last step written by the lost ranks when they last beat (0: before their first step)."""
    steps = sorted(set(steps))
    return f"last seen at step {steps[0]}" if len(steps) == 1 else f"last seen at steps {steps}"


def stacks_file(output_dir: str, rank, number: int) -> str:
    """Where rank `rank` writes its threads' stacks at the run's hang `number` (1, 2, ...)."""
    return os.path.join(rank_dir(output_dir, rank), f"hang_{number}_stacks.txt")


@dataclass(frozen=True)
class Hang:
    """A hang rank 0 declared: every watched rank's place when no rank had moved for `stalled` seconds."""

    number: int                  # 1 for the run's first hang, counted by rank 0
    stalled: float               # seconds since any rank last moved (entered a place, or finished)
    hang_after: float            # the threshold in force
    places: Dict[int, Place]     # rank -> its place
    majority: Tuple[int, str]    # the (step, phase) most ranks are in
    odd: Tuple[int, ...]         # the ranks whose (step, phase) differ from the majority's
    stacks: str                  # where the ranks write their stacks (a path with `*` for the rank)
    line: str                    # what is logged

    @property
    def step(self) -> int:
        return self.majority[0]


def _order(place: Tuple[int, str]) -> Tuple[int, int]:
    return place[0], PHASES.index(place[1]) if place[1] in PHASES else -1


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def hang_summary(places: Dict[int, Place]) -> Tuple[Tuple[int, str], List[int], str]:
    """(the majority's (step, phase), the other ranks, the phrase naming where each rank is). A tie is
    broken towards the place furthest on: the ranks behind it are the ones the others wait for."""
    groups: Dict[Tuple[int, str], List[int]] = {}
    for rank in sorted(places):
        groups.setdefault(places[rank][:2], []).append(rank)
    majority = max(groups, key=lambda place: (len(groups[place]), _order(place)))
    odd = sorted(rank for place, ranks in groups.items() if place != majority for rank in ranks)

    def where(place, ranks, verb):
        since = _clock(min(places[rank].since for rank in ranks))
        return f"{ranks_phrase(ranks)}{verb} in {place[1]} of step {place[0]} since {since}"

    if not odd:
        return majority, odd, f"all {len(places)} ranks in {majority[1]} of step {majority[0]} since " \
                              f"{_clock(min(p.since for p in places.values()))}"
    parts = [where(place, groups[place], " is" if len(groups[place]) == 1 else " are")
             for place in sorted(groups, key=_order) if place != majority]
    return majority, odd, ", ".join(parts + [where(majority, groups[majority], "")])


class PeerWatchdog(Service):
    """The group starts it when it opens (its thread begins beating or listening) and stops it when it closes
    (a goodbye, then the thread ends). It reads where training is from mindmon.core.progress, never from records."""

    def __init__(self, rank: int, world: int, address: Tuple[str, int], logger, silence: float = SILENCE,
                 interval: float = INTERVAL, startup: float = STARTUP, hang_after: Optional[float] = None,
                 output_dir: Optional[str] = None, on_hang: Optional[Callable[[Hang], None]] = None):
        self.rank, self.world, self.address, self.logger = rank, world, address, logger
        self.silence, self.interval, self.startup = silence, interval, startup
        self.hang_after, self.output_dir, self.on_hang = hang_after, output_dir, on_hang
        self.start_step = 0
        self.hangs: List[str] = []   # the hang lines this rank logged, in order
        self.verdict: Optional[str] = None   # the line logged, once
        self.on_lost: Optional[Callable[[List[int], str], None]] = None   # rank 0: (lost ranks, line)
        self.goodbye = True   # whether the end tells the others (False: they name this rank lost)
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._side = None   # the _Server or _Client the thread runs

    @property
    def token(self) -> str:
        """What both ends must agree on: another job's server at the same address is not this one's."""
        return f"{self.address[0]}:{self.address[1]}:{self.world}"

    @property
    def step(self) -> int:
        """The last step written: the one before the step in progress."""
        return max(self.start_step, PROGRESS.place.step - 1)

    def start(self, run: RunInfo) -> None:
        global _watching
        if self._thread is not None or (_watching is not None and not _watching.closed):
            return   # one watchdog a process: a second group in it (or a second open) adds nothing
        _watching = self
        self.start_step = run.start_step
        self._side = _Server(self) if self.rank == HOST_RANK else _Client(self)
        self._thread = threading.Thread(target=self._guarded, args=(self._side.run,), name="mindmon-peer-watchdog",
                                        daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    @property
    def closed(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Called while an exception is on its way out (a `finally:` or `except:` around training), this
        rank is leaving the others waiting: it ends without a goodbye, so they name it."""
        if self.closed:
            return
        self.goodbye = sys.exc_info()[1] is None
        self._stop()
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        """A program that ends without `close()` still says goodbye, unless it ends on an uncaught
        exception: then its rank is lost to the others, and they should say so."""
        if getattr(sys, "last_value", None) is None:
            self._stop()

    def _stop(self) -> None:
        self._stopping.set()
        if self.goodbye and isinstance(self._side, _Client):
            self._side.say_goodbye()   # from this thread: the watchdog's may be waiting on a held rank 0
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)

    def stopping(self, seconds: float = 0.0) -> bool:
        return self._stopping.wait(seconds) if seconds else self._stopping.is_set()

    def announce(self, line: str) -> None:
        if self.verdict is None:
            self.verdict = line
            self.logger.error("%s", line)

    def stacks_where(self, number: int) -> str:
        """Where every rank writes its stacks for hang `number`: a path with `*` for the rank."""
        return "each rank's stderr" if self.output_dir is None else stacks_file(self.output_dir, "*", number)

    def hung(self, number: int, line: str) -> None:
        """Hang `number` declared: its line logged, this process's threads' stacks written."""
        self.hangs.append(line)
        self.logger.error("%s", line)
        try:
            self._write_stacks(number, line)
        except OSError as error:
            self.logger.warning("mindmon: writing rank %d's stacks for the hang failed (%s)", self.rank,
                                error.strerror or error)

    def _write_stacks(self, number: int, line: str) -> None:
        if self.output_dir is None:
            sys.stderr.write(f"rank {self.rank}: {line}\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            return
        path = stacks_file(self.output_dir, self.rank, number)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(f"rank {self.rank}, {_clock(time.time())}: {line}\n\n")
            handle.flush()   # faulthandler writes to the file descriptor, after what Python holds
            faulthandler.dump_traceback(handle, all_threads=True)

    def _guarded(self, target) -> None:
        try:
            target()
        except Exception as error:   # the watchdog must never reach training
            self.logger.warning("mindmon: the peer watchdog stopped (%s: %s); training goes on, unwatched",
                                type(error).__name__, error)


class _Peer:
    """One rank's connection on the server."""

    def __init__(self):
        self.rank: Optional[int] = None
        self.buffer = b""


class _Server:
    """Rank 0's side: accepts the ranks' connections, tracks their heartbeats, judges, answers."""

    def __init__(self, watchdog: PeerWatchdog):
        self.watchdog = watchdog
        self.seen: Dict[int, List] = {}   # rank -> [its last step, "up" | "closed" | "silent" | "done"]
        self.first_loss: Optional[float] = None
        self.places: Dict[int, Tuple[Place, float]] = {}   # rank -> (its place, when it entered it)
        self.moved = 0.0   # when a rank last moved (entered a place, or finished), on rank 0's monotonic clock
        self.step_times = _StepTimes()
        self.hang: Optional[Tuple[int, str]] = None   # the hang in force: its number and line
        self.hangs = 0

    def run(self) -> None:
        try:
            listener = _listen(self.watchdog.address)
        except OSError as error:
            self.watchdog.logger.warning("mindmon: the peer watchdog is off: rank 0 cannot listen at %s:%d (%s)",
                                         *self.watchdog.address, error.strerror or error)
            return
        listener.setblocking(False)
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        try:
            self._loop(selector, listener)
        finally:
            for key in list(selector.get_map().values()):
                if key.fileobj is not listener and self.watchdog.goodbye:
                    _send(key.fileobj, b"bye\n")
                key.fileobj.close()
            selector.close()

    def _loop(self, selector, listener) -> None:
        while not self.watchdog.stopping():
            events = selector.select(timeout=self.watchdog.interval / 2)
            now = time.monotonic()
            for key, _ in events:
                if key.fileobj is listener:
                    self._accept(selector, listener)
                else:
                    self._read(selector, key.fileobj, key.data)
            self._judge(now)

    def _accept(self, selector, listener) -> None:
        try:
            connection, _ = listener.accept()
        except OSError:
            return
        connection.setblocking(False)
        _keep_alive(connection, self.watchdog.silence)
        selector.register(connection, selectors.EVENT_READ, _Peer())

    def _read(self, selector, connection, peer: _Peer) -> None:
        ended = "closed"
        try:
            data = connection.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            data, ended = b"", "silent" if _silent(error) else "closed"
        if not data:
            selector.unregister(connection)
            connection.close()
            if peer.rank in self.seen and self.seen[peer.rank][1] == "up":
                self.seen[peer.rank][1] = ended
            return
        peer.buffer += data
        *lines, peer.buffer = peer.buffer.split(b"\n")
        for line in lines:
            self._message(connection, peer, line.decode("ascii", "replace").split())

    def _message(self, connection, peer: _Peer, words: List[str]) -> None:
        if len(words) == 3 and words[0] == "hello" and words[1].isdigit() and words[2] == self.watchdog.token:
            peer.rank = int(words[1])
            self.seen[peer.rank] = [0, "up"]
        elif peer.rank is None:
            return
        elif len(words) in (2, 6) and words[0] == "beat" and words[1].isdigit():
            self.seen[peer.rank][0] = int(words[1])
            place, age = _parse_place(words[2:])
            if place is not None:
                self._place(peer.rank, place, time.monotonic() - age)
            _send(connection, self._answer())
        elif words == ["bye"]:
            self.seen[peer.rank][1] = "done"
            self.moved = max(self.moved, time.monotonic())   # finishing is moving: the others may wait for it

    def lost(self) -> List[int]:
        return sorted(r for r, (_, state) in self.seen.items() if state in ("closed", "silent"))

    def _answer(self) -> bytes:
        if self.watchdog.verdict:
            return f"lost {self.watchdog.verdict}\n".encode()
        if self.hang is not None:
            return f"hang {self.hang[0]} {self.hang[1]}\n".encode()
        return f"ok {self.watchdog.step}\n".encode()

    def _judge(self, now: float) -> None:
        if self.watchdog.verdict is not None:
            return
        lost = self.lost()
        if not lost:
            self.first_loss = None
            self._judge_hang(now)
            return
        if self.first_loss is None:
            self.first_loss = now
        if now - self.first_loss >= SETTLE:
            line = self.line(lost)
            self.watchdog.announce(line)
            if self.watchdog.on_lost is not None:
                try:
                    self.watchdog.on_lost(sorted(lost), line)
                except Exception as error:   # a reporter's failure must not stop the watchdog
                    self.watchdog.logger.error("mindmon: reporting the lost ranks failed (%s: %s)",
                                               type(error).__name__, error)

    def _place(self, rank: int, place: Place, changed: float) -> None:
        """`changed`: when the rank entered the place, on rank 0's monotonic clock (from the place's age on
        the rank's own clock: machines' clocks may disagree, their seconds do not)."""
        before = self.places.get(rank)
        if before is not None and before[0] == place:
            return
        self.places[rank] = (place, changed)
        self.moved = max(self.moved, changed)
        if before is not None and self.hang is not None:
            self.watchdog.logger.warning("mindmon: hang %d is over: rank %d moved on to %s of step %d", self.hang[0],
                                         rank, place.phase, place.step)
            self.hang = None

    def _judge_hang(self, now: float) -> None:
        own = PROGRESS.place
        entered = now - max(0.0, time.time() - own.since)
        self._place(HOST_RANK, own, entered)
        self.step_times.note(own.step, entered)
        watched = self._watched()
        if self.hang is not None or watched is None:
            return
        limit = self._hang_after(watched)
        stalled = now - self.moved
        if limit is None or stalled < limit:
            return
        places = {rank: place for rank, (place, _) in watched.items()}
        if {place[:2] for place in places.values()} == {(own.step, DATA)}:
            return   # every rank between the same two steps: an evaluation, a checkpoint, the end of training
        self._declare(places, stalled, limit)

    def _watched(self) -> Optional[Dict[int, Tuple[Place, float]]]:
        """The places of the ranks still training (rank 0 and every rank connected and not done); None
        until every rank has said hello and sent its place."""
        if len(self.seen) < self.watchdog.world - 1:
            return None
        ranks = [HOST_RANK] + sorted(rank for rank, (_, state) in self.seen.items() if state == "up")
        if len(ranks) < 2 or any(rank not in self.places for rank in ranks):
            return None
        return {rank: self.places[rank] for rank in ranks}

    def _hang_after(self, watched) -> Optional[float]:
        """The threshold in force; None while it does not hold yet (no step begun, or, derived, too few
        step times measured)."""
        if self.watchdog.hang_after is None:
            return self.step_times.hang_after()
        started = any(place[:2] != (0, DATA) for place, _ in watched.values())
        return self.watchdog.hang_after if started else None

    def _declare(self, places: Dict[int, Place], stalled: float, limit: float) -> None:
        self.hangs += 1
        majority, odd, where = hang_summary(places)
        stacks = self.watchdog.stacks_where(self.hangs)
        line = (f"mindmon: hang: no rank has progressed for {stalled:.1f} s (hang_after {limit:.1f} s); {where}; "
                f"stacks written to {stacks}")
        self.hang = (self.hangs, line)
        self.watchdog.hung(self.hangs, line)
        if self.watchdog.on_hang is not None:
            try:
                self.watchdog.on_hang(Hang(self.hangs, stalled, limit, places, majority, tuple(odd), stacks, line))
            except Exception as error:   # a failing receiver must not stop the watching
                self.watchdog.logger.warning("mindmon: handing the hang on failed (%s: %s)", type(error).__name__,
                                             error)

    def line(self, lost: List[int]) -> str:
        closed = [r for r in lost if self.seen[r][1] == "closed"]
        silent, one = f"{self.watchdog.silence:g} s", len(lost) == 1
        if len(closed) == len(lost):
            how = "its connection closed" if one else "their connections closed"
        elif not closed:
            how = f"{'its machine' if one else 'their machines'} gave no answer for {silent}"
        else:
            how = f"connections closed, or machines silent for {silent}"
        steps = step_phrase([self.seen[r][0] for r in lost])
        return f"mindmon: {ranks_phrase(lost)} stopped answering ({how}; {steps}); this job cannot go on"


class _Client:
    """Every other rank's side: one connection to rank 0, a heartbeat a second, and rank 0's answers."""

    def __init__(self, watchdog: PeerWatchdog):
        self.watchdog = watchdog
        self.host_step = 0
        self.heard = 0   # the number of the last hang rank 0 told of
        self.connection: Optional[socket.socket] = None

    def run(self) -> None:
        connection = self._connect()
        if connection is None:
            return
        with connection:
            connection.sendall(f"hello {self.watchdog.rank} {self.watchdog.token}\n".encode())
            self.connection = connection
            reader = connection.makefile("rb")
            while not self.watchdog.stopping():
                if not self._beat(connection, reader):
                    return
                self.watchdog.stopping(self.watchdog.interval)
            if self.watchdog.goodbye:   # again, for a close() that came before the hello went out
                self.say_goodbye()

    def say_goodbye(self) -> None:
        if self.connection is not None:
            _send(self.connection, b"bye\n")

    def _connect(self) -> Optional[socket.socket]:
        deadline = time.monotonic() + self.watchdog.startup
        error: Optional[OSError] = None
        while not self.watchdog.stopping() and time.monotonic() < deadline:
            try:
                connection = socket.create_connection(self.watchdog.address, timeout=self.watchdog.silence)
                connection.settimeout(None)   # answers may wait on a held rank 0; only its kernel's silence counts
                _keep_alive(connection, self.watchdog.silence)
                return connection
            except OSError as failure:
                error = failure
                self.watchdog.stopping(self.watchdog.interval)
        if error is not None and not self.watchdog.stopping():
            self.watchdog.logger.warning("mindmon: the peer watchdog is off: rank %d could not reach rank 0 at "
                                         "%s:%d in %g s (%s)", self.watchdog.rank, *self.watchdog.address,
                                         self.watchdog.startup, error.strerror or error)
        return None

    def _beat(self, connection, reader) -> bool:
        """One heartbeat and rank 0's answer; False when the watching is over."""
        try:
            place = PROGRESS.place
            age = max(0.0, time.time() - place.since)
            connection.sendall(f"beat {self.watchdog.step} {place.step} {place.phase} {place.since!r} {age:.3f}\n"
                               .encode())
            answer = reader.readline().decode("ascii", "replace").rstrip("\n")
        except OSError as error:
            if _silent(error):
                return self._host_lost(f"its machine gave no answer for {self.watchdog.silence:g} s")
            answer = ""
        if not answer:
            return self._host_lost("its connection closed")
        word, _, rest = answer.partition(" ")
        if word == "lost":
            self.watchdog.announce(rest)
            return False
        if word == "ok" and rest.isdigit():
            self.host_step = int(rest)
        if word == "hang":
            self._hang(rest)
        return word != "bye"   # rank 0 closed its watchdog: training is over there

    def _hang(self, told: str) -> None:
        number, _, line = told.partition(" ")
        if number.isdigit() and int(number) > self.heard:
            self.heard = int(number)
            self.watchdog.hung(self.heard, line)

    def _host_lost(self, how: str) -> bool:
        self.watchdog.announce(f"mindmon: rank {HOST_RANK} (mindmon's heartbeat host) stopped answering ({how}; "
                               f"{step_phrase([self.host_step])}); this job cannot go on (which other ranks "
                               f"were lost with it cannot be told)")
        return False


class _StepTimes:
    """Rank 0's step times, from its own place as the watchdog's thread samples it (a few per second):
    from the start of the phase first seen in a step to that of the next one seen; steps shorter than a
    sample are averaged over the steps between two samples."""

    def __init__(self):
        self.seconds: deque = deque(maxlen=HANG_WINDOW)
        self.step, self.since = 0, 0.0

    def note(self, step: int, entered: float) -> None:
        if step == self.step:
            return
        if self.step >= 1 and step > self.step:   # from step 0 to the first: the start, not a step
            self.seconds.append((entered - self.since) / (step - self.step))
        self.step, self.since = step, entered

    def hang_after(self) -> Optional[float]:
        if len(self.seconds) < HANG_MEASURED:
            return None
        return max(HANG_FLOOR, HANG_STEPS * statistics.median(self.seconds))


def _parse_place(words: List[str]) -> Tuple[Optional[Place], float]:
    """A heartbeat's `<step> <phase> <since> <seconds since then>`; (None, 0) when absent or malformed."""
    if len(words) != 4 or not words[0].isdigit():
        return None, 0.0
    try:
        return Place(int(words[0]), words[1], float(words[2])), max(0.0, float(words[3]))
    except ValueError:
        return None, 0.0


def _silent(error: OSError) -> bool:
    """The kernel gave up on a machine that answers nothing: ETIMEDOUT, or the unreachable error it met
    on the way (Linux reports that one in its place)."""
    return error.errno in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH)


def _keep_alive(connection: socket.socket, seconds: float) -> None:
    """The kernel gives up on the connection when the other machine has answered nothing for about
    `seconds`: keepalive probes while it is idle, TCP_USER_TIMEOUT while data waits for an ACK."""
    probe = max(1, int(seconds / 5))
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", probe), ("TCP_KEEPINTVL", probe), ("TCP_KEEPCNT", 4),
                        ("TCP_USER_TIMEOUT", int(seconds * 1000))):
        if hasattr(socket, name):   # Linux has them all; elsewhere the system's defaults stay
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        connection.setsockopt(level, option, value)


def _listen(address: Tuple[str, int]) -> socket.socket:
    listener = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a restarted job takes its port again
        listener.bind(address)
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


def _send(connection, data: bytes) -> None:
    try:
        connection.send(data)
    except OSError:   # a peer gone or a full buffer: the answer is dropped, the next heartbeat asks again
        pass
