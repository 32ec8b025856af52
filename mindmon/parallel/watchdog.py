"""The peer watchdog of a multi-rank run: names the ranks that stopped answering, while the survivors
wait in a collective that will never complete (docs/multi-rank.md, "A lost node").

World rank 0 hosts a small TCP server at the master's address (`MS_SCHED_HOST`, port `MS_SCHED_PORT` + 1);
every other rank keeps one connection to it and sends its last written step every second. A rank is
lost when its connection closes without a goodbye (its process died: the kernel closes its sockets)
or when its machine has not answered for `SILENCE` seconds (TCP keepalive and TCP_USER_TIMEOUT: the
machine or the network is gone). Liveness is the kernel's, not the Python thread's: a rank whose
threads are held for a while (a long call that keeps the GIL, a stopped process) is not lost. Rank 0
waits `SETTLE` seconds after the first loss, so the ranks of one node are named together, then logs
one line and answers every survivor's next heartbeat with it. A rank that loses rank 0 says so itself.

Why a thread and sockets of its own: a survivor's main thread is inside MindSpore's all-reduce, which
releases the GIL while it waits, so a daemon thread still runs; no Python handler runs on the main
thread until MindSpore's own heartbeat ends the process about 30 s later. Plain sockets, not
`mindspore.mint.distributed.TCPStore`: the watchdog needs to see a peer's connection close, and its
own waits bounded by timeouts it sets, both of which a key-value store hides.
"""
import atexit
import errno
import os
import selectors
import socket
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from mindmon.engine import RunInfo, Sink

INTERVAL = 1.0    # seconds between a rank's heartbeats
SILENCE = 10.0    # seconds without an answer from a rank's machine (to keepalive probes or data): lost
SETTLE = 2.0      # seconds rank 0 waits after the first loss, for the other ranks of the same node
STARTUP = 120.0   # seconds a rank keeps trying to reach rank 0 before it gives up (the watchdog off)
HOST_RANK = 0
_watching: Optional["PeerWatchdog"] = None   # the process's running watchdog


def endpoint() -> Optional[Tuple[str, int]]:
    """(host, port) of the heartbeat server, from msrun's environment; None outside msrun."""
    host, port = os.environ.get("MS_SCHED_HOST"), os.environ.get("MS_SCHED_PORT", "")
    if not host or not port.isdigit():
        return None
    port = int(port)
    return host, port + 1 if port < 65535 else port - 1


def peer_watchdog(logger) -> Optional["PeerWatchdog"]:
    """This rank's watchdog: None on a run of one rank, or outside msrun."""
    from mindmon.distributed import DataParallel

    world, address = DataParallel(), endpoint()
    if not world.active or address is None:
        return None
    return PeerWatchdog(world.rank, world.size, address, logger)


def ranks_phrase(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {sorted(ranks)}"


def step_phrase(steps: Sequence[int]) -> str:
    """The last step written by the lost ranks when they last beat (0: before their first step)."""
    steps = sorted(set(steps))
    return f"last seen at step {steps[0]}" if len(steps) == 1 else f"last seen at steps {steps}"


class PeerWatchdog(Sink):
    """A sink only for its place in the group's life: `open` starts the thread, `write` notes the step
    (one attribute set, no I/O), `close` says goodbye and stops the thread."""

    def __init__(self, rank: int, world: int, address: Tuple[str, int], logger, silence: float = SILENCE,
                 interval: float = INTERVAL, startup: float = STARTUP):
        self.rank, self.world, self.address, self.logger = rank, world, address, logger
        self.silence, self.interval, self.startup = silence, interval, startup
        self.step = 0
        self.verdict: Optional[str] = None   # the line logged, once
        self.goodbye = True   # whether the end tells the others (False: they name this rank lost)
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._side = None   # the _Server or _Client the thread runs

    @property
    def token(self) -> str:
        """What both ends must agree on: another job's server at the same address is not this one's."""
        return f"{self.address[0]}:{self.address[1]}:{self.world}"

    def open(self, run: RunInfo) -> None:
        global _watching
        if self._thread is not None or (_watching is not None and not _watching.closed):
            return   # one watchdog a process: a second group in it (or a second open) adds nothing
        _watching = self
        self.step = run.start_step
        self._side = _Server(self) if self.rank == HOST_RANK else _Client(self)
        self._thread = threading.Thread(target=self._guarded, args=(self._side.run,), name="mindmon-peer-watchdog",
                                        daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    def write(self, records) -> None:
        try:
            step = records[-1].step if len(records) else None
        except Exception:   # a batch that is not a list of records: the step stays as it was
            return
        if isinstance(step, int) and step > self.step:
            self.step = step

    def close(self) -> None:
        """Called while an exception is on its way out (a `finally:` or `except:` around training), this
        rank is leaving the others waiting: it ends without a goodbye, so they name it."""
        self.goodbye = sys.exc_info()[1] is None
        self._stop()
        atexit.unregister(self._at_exit)
        super().close()

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
        elif len(words) == 2 and words[0] == "beat" and words[1].isdigit():
            self.seen[peer.rank][0] = int(words[1])
            verdict = self.watchdog.verdict
            _send(connection, f"lost {verdict}\n".encode() if verdict else f"ok {self.watchdog.step}\n".encode())
        elif words == ["bye"]:
            self.seen[peer.rank][1] = "done"

    def lost(self) -> List[int]:
        return sorted(r for r, (_, state) in self.seen.items() if state in ("closed", "silent"))

    def _judge(self, now: float) -> None:
        if self.watchdog.verdict is not None:
            return
        lost = self.lost()
        if not lost:
            self.first_loss = None
            return
        if self.first_loss is None:
            self.first_loss = now
        if now - self.first_loss >= SETTLE:
            self.watchdog.announce(self.line(lost))

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
            connection.sendall(f"beat {self.watchdog.step}\n".encode())
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
        return word != "bye"   # rank 0 closed its watchdog: training is over there

    def _host_lost(self, how: str) -> bool:
        self.watchdog.announce(f"mindmon: rank {HOST_RANK} (mindmon's heartbeat host) stopped answering ({how}; "
                               f"{step_phrase([self.host_step])}); this job cannot go on (which other ranks "
                               f"were lost with it cannot be told)")
        return False


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
