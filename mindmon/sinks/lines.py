"""A sink that appends text lines to one file per rank, flushed at every step end."""
import abc
import os
from typing import List, Optional, Sequence

from mindmon.config import ConfigError
from mindmon.core.engine import RunInfo, Sink
from mindmon.formats.run_folder import RunLock
from mindmon.formats.step_file import StepFile
from mindmon.core.records import Record


def unwritable(config_key: str, configured: str, path: str, error: Exception) -> ConfigError:
    """The error for an output folder that cannot be made or written, naming the key that set it."""
    return ConfigError(f"{config_key}: got {configured!r}; cannot write {path!r} "
                       f"({getattr(error, 'strerror', None) or error}); allowed: a directory this process can "
                       f"create and write")


def claim_folder(folder: str, config_key: str, configured: str) -> RunLock:
    """The folder's `run.lock`, taken; a folder another live run is writing is a ConfigError."""
    lock = RunLock(folder)
    owner = lock.owner()
    if owner is not None:
        raise ConfigError(f"{config_key}: got {configured!r}; a running job (pid {owner[0]} on "
                          f"{owner[1]}) is writing {folder}; allowed: an output directory no live run writes "
                          f"to (if that job is gone, delete {lock.path})")
    return lock


class LinesFileSink(Sink):
    """Subclasses say where the file is (`path`) and what lines a step's records make (`lines`).

    The file is created when the run opens: a directory that cannot be made or written is a
    ConfigError naming `config_key`, before step 1. A resumed run (RunInfo.start_step > 0) appends
    to the file of the run it continues; a new run starts it afresh.
    """

    def __init__(self, output_dir: str, config_key: str = "monitor.output_dir"):
        self.output_dir = output_dir
        self.config_key = config_key
        self.path: Optional[str] = None
        self._file: Optional[StepFile] = None
        self._pending: List[str] = []   # this step's lines, written at its end

    @abc.abstractmethod
    def file_path(self, rank: int) -> str:
        pass

    @abc.abstractmethod
    def lines(self, records: Sequence[Record]) -> List[str]:
        pass

    def open(self, run: RunInfo) -> None:
        self.path = self.file_path(run.rank)
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = StepFile(self.path, fresh=not run.resumed)
        except (OSError, ValueError) as error:
            raise unwritable(self.config_key, self.output_dir, self.path, error) from None

    def write(self, records: Sequence[Record]) -> None:
        if self._file is None:
            raise RuntimeError(f"mindmon: {type(self).__name__}: write before open()")
        self._pending.extend(line + "\n" for line in self.lines(records))

    def flush(self) -> None:
        """The step's lines in one write: a failure (disk full) leaves the file whole up to the last step."""
        if self._file is not None and self._pending and not self.closed:
            text, self._pending = "".join(self._pending), []
            self._file.write(text.encode("utf-8"))

    def write_now(self, records: Sequence[Record]) -> None:
        """The records' lines out at once, in one append, not at the step's end: for a finding made on another
        thread while the step may never end (a hang). One O_APPEND write of whole lines: it cannot land
        inside another write's line."""
        if self._file is not None and not self.closed:
            self._file.write("".join(line + "\n" for line in self.lines(records)).encode("utf-8"), step_end=False)

    def close(self) -> None:
        if self._file is not None:
            try:
                self.flush()
            finally:
                self._file.close()
