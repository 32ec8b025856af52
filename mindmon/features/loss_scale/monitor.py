"""LossScaleMonitor: one step's loss scale, overflow and skipped update, and the running count of
skipped steps (docs/semantics.md, "Loss scale and overflow").

The loop hands them in once per step, after the scaler's adjustment and the (possibly skipped) update:

    finite = amp.all_finite(grads)
    scaler.adjust(finite)
    if finite:
        optimizer(grads)
    group.emit(UpdateDone(overflow=not finite, loss_scale=scaler))     # skipped defaults to overflow
    group.emit(UpdateDone(overflow=True, skipped=True))                # no scaler: no scale written

    loss, overflow, _ = train_cell(x, y)                               # a TrainOneStepWithLossScaleCell
    group.emit(UpdateDone(overflow=overflow, loss_scale=train_cell))

(`group.record("loss_scale", scaler, {"overflow": ..., "skipped": ...})` in the MindFormers monitor protocol.)

`AccumulatingTrainStep` records it itself at every step; so does `ModelMonitorCallback` under Model.train.
"""
from typing import List, Optional

from mindmon.core.engine import Monitor
from mindmon.core.events import UpdateDone
from mindmon.loop.loss_scaling import scale_of
from mindmon.kernels.stats import to_float
from mindmon.core.records import LOSS_SCALE, OVERFLOW, SKIPPED_STEPS, UPDATE_SKIPPED, Record


def _flag(value, key: str) -> bool:
    if value is None:
        raise TypeError(f'loss_scale: the record\'s context has no "{key}"; give {{"{key}": True/False}}')
    return bool(to_float(value))


class LossScaleMonitor(Monitor):
    EVENTS = (UpdateDone,)

    def __init__(self, rank: int):
        self.rank = rank
        self.skipped_steps = 0          # this process's count: a resumed run starts again at 0
        self._step: Optional[tuple] = None

    def reset(self) -> None:
        self._step = None

    def on_event(self, event) -> None:
        """`event.loss_scale`: what holds the scale (mindmon.loop.loss_scaling), read now;
        `overflow` a bool or bool Tensor; `skipped` defaults to overflow. The last one of a step wins."""
        overflow = _flag(event.overflow, "overflow")
        skipped = overflow if event.skipped is None else _flag(event.skipped, "skipped")
        self._step = (scale_of(event.loss_scale), overflow, skipped)

    def collect(self, step: int) -> List[Record]:
        if self._step is None:   # the loop said nothing this step
            return []
        (scale, overflow, skipped), self._step = self._step, None
        self.skipped_steps += int(skipped)
        records = [] if scale is None else [Record(step, None, self.rank, LOSS_SCALE, "scale", scale)]
        return records + [Record(step, None, self.rank, OVERFLOW, "grads", float(overflow)),
                          Record(step, None, self.rank, UPDATE_SKIPPED, "update", float(skipped)),
                          Record(step, None, self.rank, SKIPPED_STEPS, "total", float(self.skipped_steps))]
