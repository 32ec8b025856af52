"""A file appended in whole steps: what a failed write (a full disk, EFBIG past RLIMIT_FSIZE, EIO)
leaves is every step up to the last one written whole, never half a line, row, batch or event.

Example:
    out = StepFile("metrics.jsonl", fresh=True)
    out.write(b'{"step": 1, ...}\\n...')   # a step's bytes, on disk (the kernel's cache) when it returns
    out.write(b"...", step_end=False)       # part of a step (a writer's buffer ran full)
    out.write(b"...")                       # fails: the file is cut back to the end of step 1, the error raised
"""
import os


class StepFile:
    """Each `write` goes out with os.write until done (no user-space buffer to lose at a kill). A write
    that fails cuts the file back to `kept`, the end of the last step written whole, and raises."""

    def __init__(self, path: str, fresh: bool):
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0)
        self._fd = os.open(path, flags, 0o666)
        self.kept = os.fstat(self._fd).st_size

    def write(self, data: bytes, step_end: bool = True) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            os.ftruncate(self._fd, self.kept)   # O_APPEND: a later write goes to the cut end
            raise
        if step_end:
            self.kept = os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def append_whole(path: str, data: bytes) -> None:
    """Appends `data` in one piece to `path` (made when missing): when the write fails the file is cut
    back to what it held (a file it made is removed) and the error raised."""
    existed = os.path.exists(path)
    out = StepFile(path, fresh=False)
    try:
        out.write(data)
    except OSError:
        out.close()
        if not existed:
            os.remove(path)
        raise
    out.close()
