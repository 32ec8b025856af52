"""The delivery buffer of one recipient: a FIFO of anomalies in memory up to a limit, then in a
spool file on disk up to a second limit, then dropped (counted by the caller).

Order is kept by one rule: an anomaly goes to memory only while the spool holds nothing unread,
so everything in memory is older than everything in the spool. The delivery thread reads a batch
from the front (`take`) and removes it only once it was delivered (`done`); a failed batch stays
at the front and is taken again.

The spool (`<output>/anomaly_detected/rank<r>/spool/<recipient id>.jsonl`, one JSON object per
line: run id, idempotency key, the dump's entry) is appended to and read from the front; when
everything in it was delivered it is emptied. At the end (`finish`) it is rewritten, atomically, to
hold exactly what was not delivered, memory included, next to `<recipient id>.json` naming the
recipient (password masked): what `mindmon alerts resend` reads. A spool left by an earlier run
into the same folder for the same recipient is delivered first.

`<recipient id>.delivered` holds the byte offset of the first line not yet confirmed delivered,
written (one 20-byte write, no fsync: a process kill, not a power cut) each time a batch taken from
the spool was confirmed, so that the spool a killed process leaves, and `mindmon alerts resend`,
start after what was confirmed: for e-mail, which has no idempotency key, the difference between
sending a confirmed digest again and not.
"""
import json
import os
import threading
from collections import deque
from itertools import islice
from typing import Iterator, List, Optional, Tuple

from mindmon.features.alerts.anomaly import KeyedAnomaly
from mindmon.features.alerts.dump import write_json_atomically

SPOOL_DIR = "spool"


class Spool:
    """An append-only JSON-lines file read from the front. Not thread-safe: the buffer locks."""

    def __init__(self, path: str, limit: int, recipient: dict):
        self.path, self.limit, self.recipient = path, limit, recipient
        self.unread = 0        # anomalies after read_pos
        self.read_pos = 0      # byte offset of the first undelivered line
        self.size = 0          # bytes in the file
        self._head: Optional[Tuple[List[KeyedAnomaly], List[int]]] = None   # the batch taken, where each line ends
        self._adopt()

    def _adopt(self) -> None:
        """What an earlier run left: whole lines only (a cut last line is cut off)."""
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]
        if len(whole) < len(data):
            os.truncate(self.path, len(whole))
        self.read_pos = confirmed_position(self.path, whole)
        self.size, self.unread = len(whole), whole.count(b"\n", self.read_pos)

    @property
    def sidecar(self) -> str:
        return self.path[:-len(".jsonl")] + ".json"

    @property
    def position_file(self) -> str:
        return delivered_position_file(self.path)

    def _note_position(self) -> None:
        if self.read_pos == 0:
            if os.path.exists(self.position_file):
                os.remove(self.position_file)
            return
        descriptor = os.open(self.position_file, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(descriptor, b"%019d\n" % self.read_pos, 0)
        finally:
            os.close(descriptor)

    def has_room(self, n: int) -> bool:
        return self.unread + n <= self.limit

    def append(self, items: List[KeyedAnomaly]) -> None:
        """Writes whole lines or nothing: on an error the file is cut back to its last whole line."""
        data = "".join(item.to_line() for item in items).encode()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if self.size == 0:
            write_json_atomically(self.sidecar, {"recipient": self.recipient})
        try:
            with open(self.path, "ab") as f:
                f.write(data)
        except OSError:
            try:
                os.truncate(self.path, self.size)
            except OSError:
                pass
            raise
        self.size += len(data)
        self.unread += len(items)

    def take(self, n: int) -> List[KeyedAnomaly]:
        if self._head is None or len(self._head[0]) < min(n, self.unread):
            items, ends, end = [], [], self.read_pos
            with open(self.path, "rb") as f:
                f.seek(self.read_pos)
                for line in islice(f, min(n, self.unread)):
                    items.append(KeyedAnomaly.from_line(line.decode()))
                    end += len(line)
                    ends.append(end)
            self._head = (items, ends)
        return self._head[0][:n]

    def done(self, n: int) -> None:
        self.read_pos, self.unread, self._head = self._head[1][n - 1], self.unread - n, None
        if self.unread == 0:
            os.truncate(self.path, 0)
            self.read_pos = self.size = 0
        try:
            self._note_position()
        except OSError:   # not recorded: a killed process's spool may send these again (at least once)
            pass

    def unread_lines(self) -> Iterator[bytes]:
        if self.unread == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(self.read_pos)
            yield from f


class DeliveryBuffer:
    """Thread-safe: `put` from the training thread, `take`/`done` from the delivery thread.

    Example:
        buffer = DeliveryBuffer(memory_limit=10000, spool=Spool(path, 10**6, inform.to_dict()))
        dropped = buffer.put(items)          # items that fit neither in memory nor in the spool
        batch = buffer.take(500); ...; buffer.done(len(batch))
        left, error = buffer.finish()        # everything undelivered, now in the spool file
    """

    def __init__(self, memory_limit: int, spool: Optional[Spool]):
        self.memory_limit, self.spool = memory_limit, spool
        self.memory: deque = deque()
        self.lock = threading.Lock()
        self.arrived = threading.Event()
        self.closed = False
        self.spilled = 0

    def __len__(self) -> int:
        with self.lock:
            return len(self.memory) + (self.spool.unread if self.spool else 0)

    def put(self, items: List[KeyedAnomaly]) -> Tuple[int, Optional[OSError]]:
        """(how many were dropped, the disk error that dropped them or None)."""
        with self.lock:
            if self.closed:
                return len(items), None
            spool_empty = self.spool is None or self.spool.unread == 0
            fit = max(0, self.memory_limit - len(self.memory)) if spool_empty else 0
            self.memory.extend(items[:fit])
            rest = items[fit:]
            error = None
            if rest and self.spool is not None and self.spool.has_room(len(rest)):
                try:
                    self.spool.append(rest)
                    self.spilled += len(rest)
                    rest = []
                except OSError as failure:
                    error = failure
        self.arrived.set()
        return len(rest), error

    def take(self, n: int) -> List[KeyedAnomaly]:
        """The first n undelivered anomalies, oldest first (not removed)."""
        with self.lock:
            items = list(islice(self.memory, n))
            if len(items) < n and self.spool is not None and self.spool.unread:
                items += self.spool.take(n - len(items))
            if not items:
                self.arrived.clear()
            return items

    def done(self, n: int) -> None:
        """The first n taken were delivered. Ignored once `finish` ran (a late attempt)."""
        with self.lock:
            if self.closed:
                return
            from_memory = min(n, len(self.memory))
            for _ in range(from_memory):
                self.memory.popleft()
            if n > from_memory:
                self.spool.done(n - from_memory)

    def finish(self) -> Tuple[int, Optional[OSError]]:
        """Leaves everything undelivered in the spool file (or removes an empty one); returns how
        many are there and the error when the file could not be written (they stay in the dump)."""
        with self.lock:
            self.closed = True
            left = len(self.memory) + (self.spool.unread if self.spool else 0)
            if self.spool is None:
                return left, None
            try:
                self._rewrite_spool(left)
            except OSError as error:
                return left, error
            return left, None

    def _rewrite_spool(self, left: int) -> None:
        """The position goes before the new file replaces the old: killed in between, the old spool is
        read from its start (sent again, never skipped)."""
        spool = self.spool
        if left == 0:
            self._forget_position()
            for path in (spool.path, spool.sidecar):
                if os.path.exists(path):
                    os.remove(path)
            return
        os.makedirs(os.path.dirname(spool.path), exist_ok=True)
        temporary = f"{spool.path}.tmp{os.getpid()}"
        try:
            with open(temporary, "wb") as f:
                f.writelines(item.to_line().encode() for item in self.memory)
                f.writelines(spool.unread_lines())
            self._forget_position()
            os.replace(temporary, spool.path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
        write_json_atomically(spool.sidecar, {"recipient": spool.recipient, "count": left})


    def _forget_position(self) -> None:
        if os.path.exists(self.spool.position_file):
            os.remove(self.spool.position_file)


def delivered_position_file(spool_path: str) -> str:
    return spool_path[:-len(".jsonl")] + ".delivered"


def confirmed_position(spool_path: str, whole: bytes) -> int:
    """The offset after the lines confirmed delivered; 0 when none is recorded or the record does
    not fit this file (a line start within it)."""
    try:
        with open(delivered_position_file(spool_path), "rb") as f:
            position = int(f.read(20))
    except (OSError, ValueError):
        return 0
    return position if 0 < position <= len(whole) and whole[position - 1:position] == b"\n" else 0


def read_spool(path: str) -> Tuple[dict, List[KeyedAnomaly]]:
    """(the recipient it was meant for, password masked; its anomalies not yet confirmed delivered, in order)."""
    with open(path[:-len(".jsonl")] + ".json", encoding="utf-8") as f:
        recipient = json.load(f)["recipient"]
    with open(path, "rb") as f:
        whole = f.read()
    whole = whole[:whole.rfind(b"\n") + 1]
    lines = whole[confirmed_position(path, whole):].decode().splitlines(keepends=True)
    return recipient, [KeyedAnomaly.from_line(line) for line in lines]
