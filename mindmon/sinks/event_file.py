"""A TensorBoard event file (`events.out.tfevents.<time>.<host>.<pid>.<n>`, as PyTorch's writer names them;
TFRecord framing of tensorboardX's Event protos), written by the caller's thread in whole steps.

tensorboardX's SummaryWriter writes from a thread of its own: a write that fails there (a full disk)
kills that thread with a traceback on stderr, leaves half an event in the file, fails again at exit,
and would block training once its queue filled. Here the summaries are still tensorboardX's
(`tensorboardX.summary.scalar`, `image`), the file is mindmon.formats.step_file's: a failure is raised
in the step that hit it, and the file keeps every step up to the last one written whole.

Example:
    events = EventFile("./output/tensorboard/rank_0", max_pending=1000)
    events.add_scalar("grad-norm", 1.19, step=1)
    events.flush()            # step 1 is on disk
    events.close()
"""
import itertools
import os
import socket
import struct
import time
from typing import List

from mindmon.formats.step_file import StepFile

_FILES = itertools.count()   # the process's files: two opened in one second in one folder stay two


def _framed(event) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC."""
    from tensorboardX.record_writer import masked_crc32c

    data = event.SerializeToString()
    header = struct.pack("Q", len(data))
    return header + struct.pack("I", masked_crc32c(header)) + data + struct.pack("I", masked_crc32c(data))


class EventFile:
    """Events are held until `flush` (the step end), or until `max_pending` of them wait (written then as
    part of the step: a later failure still cuts the file back to the last step end)."""

    def __init__(self, log_dir: str, max_pending: int = 1000):
        from tensorboardX.proto import event_pb2

        self._event = event_pb2.Event
        self.path = os.path.join(log_dir, f"events.out.tfevents.{str(time.time())[:10]}.{socket.gethostname()}"
                                          f".{os.getpid()}.{next(_FILES)}")
        self.max_pending = max_pending
        self._pending: List[bytes] = []
        self._file = StepFile(self.path, fresh=True)
        self._add(self._event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def add_summary(self, summary, step: int) -> None:
        """A Summary proto as it is: its tags are written as given (tensorboardX's own helpers turn `:`
        into `_`, where PyTorch's writer, which msprobe uses, keeps it: `0:fc1.weight/rank0/post_grad_norm`)."""
        self._add(self._event(summary=summary, wall_time=time.time(), step=int(step)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary()
        entry = summary.value.add()
        entry.tag, entry.simple_value = tag, float(value)
        self.add_summary(summary, step)

    def add_image(self, tag: str, image, step: int, dataformats: str = "HWC") -> None:
        from tensorboardX.summary import image as image_summary

        summary = image_summary("image", image, dataformats=dataformats)
        summary.value[0].tag = tag   # built under a placeholder, so the tag is not rewritten
        self.add_summary(summary, step)

    def _add(self, event) -> None:
        self._pending.append(_framed(event))
        if len(self._pending) >= self.max_pending:
            self._write(step_end=False)

    def _write(self, step_end: bool) -> None:
        data, self._pending = b"".join(self._pending), []
        self._file.write(data, step_end=step_end)

    def flush(self) -> None:
        self._write(step_end=True)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._file.close()
