"""`<output>/anomaly_detected/rank<r>/anomaly.json`: msprobe's schema, one entry per (tag,
statistic, step, micro-step), one line each.

A step's cost is proportional to that step's new anomalies, not to all found so far, and the name
`anomaly.json` always names a complete file of whole steps, whatever instant the process is killed
at. Two files hold the dump: `anomaly.json` and a spare (`.anomaly.json.spare`, one step behind).
At step end the spare is brought up to date in place (its closing brace overwritten by the missing
entries and a new brace), then renamed over `anomaly.json`; the file it replaces keeps a name as
the new spare (a hard link made first). Rewriting one JSON object whole at every step cost a storm
of 10^4 anomalies a step about a second a step after a few hundred steps; an in-place append alone
leaves a cut file when a kill lands inside the write. Where hard links are refused, each step
copies the dump to the spare first (correct, proportional to the whole dump)."""
import json
import os
import shutil
from typing import Iterable, List, Optional, Set

from mindmon.features.alerts.anomaly import Anomaly

DUMP_DIR = "anomaly_detected"
DUMP_FILE = "anomaly.json"
SPARE_FILE = ".anomaly.json.spare"
EMPTY = b"{\n}\n"
CLOSING = b"\n}\n"


def dump_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, DUMP_DIR, f"rank{rank}", DUMP_FILE)


def write_text_atomically(path: str, text: str) -> None:
    """Through a temporary file and os.replace: a crash or a full disk leaves the previous file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_json_atomically(path: str, data) -> None:
    write_text_atomically(path, json.dumps(data, indent=4, allow_nan=False))


def _line(key: str, entry: dict) -> str:
    return f"    {json.dumps(key)}: {json.dumps(entry, allow_nan=False)}"


def append_entries(path: str, size: int, lines: List[str]) -> int:
    """Appends entry lines to the JSON object in `path` (`size` bytes, ending in the closing brace)
    in place: the brace is overwritten by the lines and a new brace. Returns the new size."""
    body = ",\n".join(lines).encode()
    offset, data = (2, body + CLOSING) if size == len(EMPTY) else (size - len(CLOSING), b",\n" + body + CLOSING)
    descriptor = os.open(path, os.O_WRONLY)
    try:
        written = 0
        while written < len(data):
            written += os.pwrite(descriptor, data[written:], offset + written)
    finally:
        os.close(descriptor)
    return offset + len(data)


class AnomalyDump:
    """Example:
        dump = AnomalyDump("./output/monitor", rank=0)
        dump.add(anomalies)
        dump.write()      # only when something was added since the last write
        dump.finish()     # at the end: removes the spare

    Each entry is encoded once, when added; `write` costs the lines added since the spare was
    last written (this step's and the step before's), a hard link and two renames."""

    def __init__(self, output_dir: str, rank: int):
        self.output_dir = output_dir
        self.path = dump_path(output_dir, rank)
        self.keys: Set[str] = set()
        self.ours = False                      # anomaly.json is this run's (or a resumed run's) file
        self.size = len(EMPTY)                 # its bytes
        self.pending: List[str] = []           # lines not yet in anomaly.json
        self.behind: List[str] = []            # lines in anomaly.json, not yet in the spare
        self.spare_size: Optional[int] = None  # None: no spare to trust (made from anomaly.json first)

    @property
    def spare(self) -> str:
        return os.path.join(os.path.dirname(self.path), SPARE_FILE)

    def set_rank(self, rank: int) -> None:
        self.path = dump_path(self.output_dir, rank)

    def load_existing(self) -> None:
        """A resumed run keeps what the earlier run dumped."""
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                self.keys |= set(json.load(f))
            self.ours, self.size = True, os.path.getsize(self.path)

    def add(self, anomalies: Iterable[Anomaly]) -> None:
        for anomaly in anomalies:
            key, n = anomaly.key, 1
            while key in self.keys:  # the same record written twice: keep both
                key, n = f"{anomaly.key}_{n}", n + 1
            self.keys.add(key)
            self.pending.append(_line(key, anomaly.to_json()))

    def write(self) -> None:
        """A failure (disk full) leaves anomaly.json as it was and keeps the lines for the next write."""
        if not self.pending:
            return
        if self.spare_size is None:
            self.spare_size, self.behind = self._make_spare(), []
        start, self.spare_size = self.spare_size, None   # a failed append leaves no spare to trust
        size, previous = append_entries(self.spare, start, self.behind + self.pending), self.size
        kept = self._keep_current()
        os.replace(self.spare, self.path)
        self.ours, self.size, self.behind, self.pending = True, size, self.pending, []
        if kept is not None:
            os.replace(kept, self.spare)
            self.spare_size = previous

    def _make_spare(self) -> int:
        """The spare from anomaly.json (a copy of this run's file, an empty object for a fresh run)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if self.ours:
            shutil.copyfile(self.path, self.spare)
            return self.size
        with open(self.spare, "wb") as f:
            f.write(EMPTY)
        return len(EMPTY)

    def _keep_current(self) -> Optional[str]:
        """A second name for the file anomaly.json names now, so that it survives the rename as the
        next spare; None for a fresh run's first write, or where hard links are refused."""
        if not self.ours:
            return None
        kept = self.spare + ".next"
        try:
            if os.path.lexists(kept):
                os.remove(kept)
            os.link(self.path, kept)
        except OSError:
            return None
        return kept

    def finish(self) -> None:
        """The spare is not needed once the run ends (a resumed run makes one from anomaly.json)."""
        for path in (self.spare, self.spare + ".next"):
            if os.path.lexists(path):
                try:
                    os.remove(path)
                except OSError:
                    pass
        self.spare_size = None


def rank_folder(output_dir: str, rank: int) -> str:
    """`<output>/anomaly_detected/rank<r>`: the dump, the run id and the delivery spools of one rank."""
    return os.path.join(output_dir, DUMP_DIR, f"rank{rank}")


def run_id_of(output_dir: str, rank: int, resumed: bool) -> str:
    """The run's id in the rank's folder (`run_id`): a new one for a fresh run, the earlier one
    for a resumed run. Unwritable folder: an id for this process only."""
    import uuid

    path = os.path.join(rank_folder(output_dir, rank), "run_id")
    if resumed and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            existing = f.read().strip()
        if existing:
            return existing
    run_id = uuid.uuid4().hex
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(run_id + "\n")
    except OSError:
        pass
    return run_id
