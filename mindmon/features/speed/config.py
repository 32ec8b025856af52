"""The `monitor.speed` section: how fast the run goes, where the step's time goes, and which rank is slow."""
from dataclasses import dataclass
from typing import Any, Optional

from mindmon.config import ConfigError, check_bool, check_keys, check_positive_number

PATH = "monitor.speed"


@dataclass(frozen=True)
class SpeedConfig:
    enabled: bool = False
    """Per step on every rank: the step's wall time and its phases, samples and tokens per second, the
    wall-clock time, the ETA, peak memory; across the data-parallel ranks on rank 0."""

    flops: bool = False
    """Count the model's FLOPs (useful and executed) and give MFU and HFU; attaches forward hooks to the
    cells that multiply matrices."""

    peak_tflops: Optional[float] = None
    """The device's dense peak in TFLOP/s for MFU, in place of the table's figure for a known device; an
    unknown device without it gives no MFU."""

    slow_rank_factor: float = 1.2
    """A rank is slow at a step when its computing time before the gradient collective exceeds this
    factor times the median over the ranks (the `slow_rank` record and alert rule)."""

    throughput_drop: float = 0.5
    """Rank 0 writes a `throughput_drop` record (and the alert event of that name) at a step whose samples per
    second fall below this share of the median of the 20 steps before it."""

    hang_after: Optional[float] = None
    """Seconds with no rank making progress after which rank 0 declares a hang; unset: derived from the
    median step time (docs/multi-rank.md)."""

    KEYS = ("enabled", "flops", "peak_tflops", "slow_rank_factor", "throughput_drop", "hang_after")

    @property
    def active(self) -> bool:
        return self.enabled

    @classmethod
    def parse(cls, path: str, section: Any) -> "SpeedConfig":
        section = check_keys(path, section, cls.KEYS)
        out: dict = {}
        for key in ("enabled", "flops"):
            if key in section:
                out[key] = check_bool(f"{path}.{key}", section[key])
        for key in ("peak_tflops", "hang_after"):
            if section.get(key) is not None:
                out[key] = check_positive_number(f"{path}.{key}", section[key])
        if "slow_rank_factor" in section:
            factor = check_positive_number(f"{path}.slow_rank_factor", section["slow_rank_factor"],
                                           "a finite number > 1")
            if factor <= 1:
                raise ConfigError(f"{path}.slow_rank_factor: got {factor}; allowed: a finite number > 1")
            out["slow_rank_factor"] = factor
        if "throughput_drop" in section:
            share = check_positive_number(f"{path}.throughput_drop", section["throughput_drop"],
                                          "a share between 0 and 1")
            if share >= 1:
                raise ConfigError(f"{path}.throughput_drop: got {share}; allowed: a share between 0 and 1")
            out["throughput_drop"] = share
        return cls(**out)

    def to_dict(self) -> dict:
        return {key: getattr(self, key) for key in self.KEYS}
