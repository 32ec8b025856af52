"""LogSink: the documented training-log lines (mindmon.formats.log_lines), through a logger."""
import logging
from typing import List, Optional, Sequence

from mindmon.core.engine import RunInfo, Sink
from mindmon.formats.log_lines import format_lines
from mindmon.core.records import Record


class LogSink(Sink):
    """Writes a step's lines through a logger (MindFormers' logger when it is there) in one call: the
    logger's prefix (time, level, file) heads the step's block and every documented line follows on
    its own line, as written. One call per step instead of one per line: `logging` costs tens of
    microseconds a call, and a step of a large model has hundreds of lines.

    Example:
        sink = LogSink(logging.getLogger("mindmon"))
        sink.write([Record(4, 2, 0, "local_loss", "loss", 0.123)])  # { "micro_step": 2, "local_loss": 0.123 }
    """

    def __init__(self, logger: Optional[logging.Logger] = None):
        self.logger = logger or logging.getLogger("mindmon")
        self.max_steps: Optional[int] = None

    def open(self, run: RunInfo) -> None:
        self.max_steps = run.max_steps

    def write(self, records: Sequence[Record]) -> None:
        lines = self.lines(list(records))
        if lines:
            self.logger.info("\n".join(lines))

    def lines(self, records: List[Record]) -> List[str]:
        """The step's lines, in the documented order (a subclass may write other formats)."""
        return format_lines(records, self.max_steps)
