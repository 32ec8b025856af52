"""The step-level values a training loop knows at step end, as records: the step's loss, the global
gradient norm before clipping, the learning rate, the samples consumed, and the clipping threshold.

MindFormers' Trainer hands them to its callbacks (`MonitorCallback` passes them on); a plain loop
hands them to `MonitorGroup.flush(step, loss=..., grad_norm=..., learning_rate=...)`. Both end
here, so both write the same records (docs/semantics.md).
"""
from typing import List, Optional

from mindmon.core.records import GRAD_NORM, LEARNING_RATE, LOSS, MAX_NORM, SAMPLES, Record
from mindmon.kernels.stats import to_float


def step_value_records(step: int, rank: int, loss=None, grad_norm=None, learning_rate=None,
                       global_batch_size: Optional[int] = None, max_norm: Optional[float] = None) -> List[Record]:
    """The records of one step's values, in the order the Trainer's callback wrote them: `loss`
    ("loss"), `grad_norm` ("global"), `learning_rate` ("lr"), `samples` ("consumed": step x global
    batch size, when that is known), then `max_norm` ("global") next to a grad_norm when clipping is
    on (max_norm > 0). Values left None are not written."""
    given = [(LOSS, "loss", loss), (GRAD_NORM, "global", grad_norm), (LEARNING_RATE, "lr", learning_rate)]
    values = [(kind, name, to_float(value)) for kind, name, value in given if value is not None]
    if global_batch_size:
        values.append((SAMPLES, "consumed", float(step * global_batch_size)))
    if max_norm and grad_norm is not None:   # 0 or None: clipping off, or no train step told the group
        values.append((MAX_NORM, "global", float(max_norm)))
    return [Record(step, None, rank, kind, name, value) for kind, name, value in values]
