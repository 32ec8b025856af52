"""The `monitor.speed` section: how fast the run goes, where the step's time goes, and which rank is slow."""
from dataclasses import dataclass
from typing import Optional

from mindmon.config import Section, setting
from mindmon.config.fields import boolean, optional, positive_number

PATH = "monitor.speed"


@dataclass(frozen=True)
class SpeedConfig(Section):
    enabled: bool = setting(False, boolean())
    """Per step on every rank: the step's wall time and its phases (`data`, `forward_backward` and each
    micro-batch, `reduce`, `update`, `mindmon`, `other`), samples and tokens per second (this rank and the
    job), the wall-clock time, the ETA when the number of steps is known, the step's peak resident memory
    (and the device's peak where MindSpore reports it); with several data-parallel ranks, rank 0 also writes
    their min / mean / max and extreme ranks and names slow ranks."""

    flops: bool = setting(False, boolean())
    """Count the model's FLOPs each step (useful and executed, [flops](flops.md)) and write MFU and HFU;
    attaches forward hooks to the cells that multiply matrices, so it needs the model."""

    peak_tflops: Optional[float] = setting(None, optional(positive_number()), shown_default="unset")
    """The device's dense peak in TFLOP/s for MFU, in place of the table's figure for a known device; an
    unknown device without it has no MFU (said once)."""

    slow_rank_factor: float = setting(1.2, positive_number("a finite number > 1", above=1, kind="number > 1"))
    """A rank is named slow at a step when its computing time before the gradient collective exceeds this
    factor times the median over the ranks (the `slow_rank` record and alert rule)."""

    throughput_drop: float = setting(0.5, positive_number("a share between 0 and 1", below=1,
                                                          kind="number in (0, 1)"))
    """Rank 0 writes a `throughput_drop` record (and the run event of that name) at a step whose samples per
    second fall below this share of the median of the 20 steps before it."""

    hang_after: Optional[float] = setting(None, optional(positive_number()), shown_default="unset")
    """Seconds with no rank making progress after which rank 0 declares a hang; unset: derived from the
    median step time ([multi-rank](multi-rank.md))."""

    @property
    def active(self) -> bool:
        return self.enabled
