"""The record that flows from a monitor to the sinks."""
from dataclasses import dataclass
from typing import List, Optional, Union

# Kinds written by the train_state monitor.
LOCAL_LOSS = "local_loss"      # loss of one micro-batch (not divided by K)
LOCAL_NORM = "local_norm"      # A_k - A_{k-1}: increment of the accumulated-gradient norm at micro-step k
MICRO_NORM = "micro_norm"      # |g_k|: norm of micro-batch k's own contribution (gradient of loss_k / K)
DEVICE_NORM = "device_norm"    # A_{K-1}: norm of the accumulated gradient, before clipping
DEVICE_LOSS = "device_loss"    # mean of the step's micro-batch losses


@dataclass(frozen=True)
class Record:
    """One value: `step` is 1-based like MindFormers' `step:[  1/ 20]`; `micro_step` is 0-based,
    None for step-level values."""

    step: int
    micro_step: Optional[int]
    rank: int
    kind: str
    name: str
    value: Union[float, List[float]]

    def to_json(self) -> dict:
        return {"step": self.step, "micro_step": self.micro_step, "rank": self.rank,
                "kind": self.kind, "name": self.name, "value": self.value}
