"""The step's events (mindmon/core/events.py) told from TrainerMon's hooks, for the speed monitor (docs/speed.md).

msprobe's loop is the user's own: mindmon sees the model's forward calls and the optimizer's call, so that
is where the step's moments are taken:

    StepBegin          the model's first forward of the step (training mode)
    MicroBatchEnd(k)   the forward of micro-batch k + 1 begins, or the optimizer is called (the last one);
                       its samples and tokens from the model's first input (mindmon.loop.step.batch_size)
    GradientsReduced   the optimizer is called (no `reduce` phase: the loop's collectives are its own)
    UpdateDone         the optimizer returns
    StepEnd            right after, with every record of the step (`group.flush`)

The forward pre-hook is attached before the tensor statistics' hooks (StepBegin resets the monitors, so
it must come before the step's first record) and the optimizer's hooks after them (the step's last
records, `param_updated`, are taken before the flush).
"""
from typing import Callable, List, Optional, Tuple

from mindmon.core.events import GradientsReduced, MicroBatchEnd, StepBegin, UpdateDone
from mindmon.core.optimizer_hooks import hook_optimizer_calls
from mindmon.loop.step import batch_size


class StepEvents:
    """`attach_model` before the tensor statistics' hooks, `attach_optimizer` after them; `remove()`."""

    def __init__(self, group, first_step: int, on_step_end: Callable[[int], None]):
        self.group, self.on_step_end = group, on_step_end
        self.steps_done = first_step            # records count steps from 1: step n ends with flush(n + 1)
        self.sizes: List[Tuple[Optional[int], Optional[int]]] = []   # (samples, tokens) of each forward
        self.handles: List = []
        self.has_optimizer = False

    def attach_model(self, model) -> None:
        self.handles.append(model.register_forward_pre_hook(self._forward_begins))

    def attach_optimizer(self, optimizer) -> None:
        self.handles += hook_optimizer_calls(optimizer, self._update_begins, self._update_done)
        self.has_optimizer = True

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _forward_begins(self, cell, inputs) -> None:
        if not cell.training or not self.has_optimizer:
            return
        if not self.sizes:
            self.group.emit(StepBegin())
        else:
            self.group.emit(MicroBatchEnd(len(self.sizes) - 1, *self.sizes[-1]))
        self.sizes.append(batch_size(inputs))

    def _update_begins(self, optimizer, inputs) -> None:
        if self.sizes:
            self.group.emit(MicroBatchEnd(len(self.sizes) - 1, *self.sizes[-1]))
        self.group.emit(GradientsReduced(None))

    def _update_done(self, optimizer, inputs, output) -> None:
        self.group.emit(UpdateDone())
        self.sizes = []
        self.steps_done += 1
        self.on_step_end(self.steps_done)
