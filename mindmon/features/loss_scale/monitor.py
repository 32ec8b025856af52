"""LossScaleMonitor: one step's loss scale, overflow and skipped update, and the running count of
skipped steps (docs/semantics.md, "Loss scale and overflow").

The loop hands them in once per step, after the scaler's adjustment and the (possibly skipped) update:

    finite = amp.all_finite(grads)
    scaler.adjust(finite)
    if finite:
        optimizer(grads)
    group.record("loss_scale", scaler, {"overflow": not finite})           # skipped defaults to overflow
    group.record("loss_scale", None, {"overflow": True, "skipped": True})  # no scaler: no scale written

    loss, overflow, _ = train_cell(x, y)                                   # a TrainOneStepWithLossScaleCell
    group.record("loss_scale", train_cell, {"overflow": overflow})

`AccumulatingTrainStep` records it itself at every step; so does `ModelMonitorCallback` under Model.train.
"""
from typing import List, Optional

from mindmon.engine import Monitor
from mindmon.features.loss_scale.scale import scale_of
from mindmon.kernels.stats import to_float
from mindmon.records import LOSS_SCALE, OVERFLOW, SKIPPED_STEPS, UPDATE_SKIPPED, Record


def _flag(value, key: str) -> bool:
    if value is None:
        raise TypeError(f'loss_scale: the record\'s context has no "{key}"; give {{"{key}": True/False}}')
    return bool(to_float(value))


class LossScaleMonitor(Monitor):
    KEYS = ("loss_scale",)

    def __init__(self, rank: int):
        self.rank = rank
        self.skipped_steps = 0          # this process's count: a resumed run starts again at 0
        self._step: Optional[tuple] = None

    def reset(self) -> None:
        self._step = None

    def record(self, key, value=None, context=None) -> None:
        """`value`: what holds the scale (mindmon.features.loss_scale.scale), read now; `context`:
        {"overflow": bool or bool Tensor, "skipped": optional, defaults to overflow}. The last
        record of a step wins."""
        context = context or {}
        overflow = _flag(context.get("overflow"), "overflow")
        skipped = overflow if context.get("skipped") is None else _flag(context["skipped"], "skipped")
        self._step = (scale_of(value), overflow, skipped)

    def collect(self, step: int) -> List[Record]:
        if self._step is None:   # the loop said nothing this step
            return []
        (scale, overflow, skipped), self._step = self._step, None
        self.skipped_steps += int(skipped)
        records = [] if scale is None else [Record(step, None, self.rank, LOSS_SCALE, "scale", scale)]
        return records + [Record(step, None, self.rank, OVERFLOW, "grads", float(overflow)),
                          Record(step, None, self.rank, UPDATE_SKIPPED, "update", float(skipped)),
                          Record(step, None, self.rank, SKIPPED_STEPS, "total", float(self.skipped_steps))]
