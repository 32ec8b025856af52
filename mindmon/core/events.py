"""What the training step tells the monitors: one typed event per thing that happens in a step.

The training loop (mindmon.loop.step), the `Model.train` callback and the MindFormers integration emit these
through `MonitorGroup.emit`; a monitor lists the event types it takes in `EVENTS` and receives them in
`on_event`. The loop knows no feature: a capability that needs to know when something happens subscribes
to its event, and one that needs a new moment of the step adds an event here.

A step, in the order the loop emits:

    StepBegin
    MicroBatchLoss(k), MicroBatchGradients(k), MicroBatchEnd(k)     for each micro-batch k = 0..K-1
    ReduceBegin                                  the gradients enter the collective over the ranks
    GradientsReduced                             the data-parallel mean (or the accumulated sum, one rank)
    MicroBatchLosses                             pipeline parallelism only: the last stage's losses
    UpdateDone                                   clipped and applied (or skipped)
    StepLoss                                     the step's mean loss
    StepEnd(step)                                emitted by MonitorGroup.flush, before the monitors collect
    StepWritten(step)                            emitted by MonitorGroup.flush once every output has the step

Every event carries `at`, the `time.perf_counter()` at which the group received it, and `mindmon_seconds`,
mindmon's own time since the last StepEnd at that moment (so a phase's time can leave mindmon's out).

The newer MindFormers trainer's monitor protocol, `record(key, value, context)`, names some of these
events by string; `from_record` maps that dialect onto them, so a trainer or plain loop written for it
drives the same monitors.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

from mindmon.core.progress import DATA, FORWARD_BACKWARD, MONITOR, REDUCE, UPDATE


@dataclass
class GradientSnapshot:
    """The gradients after one micro-step: the micro-batch's own and the accumulated ones, both in the
    order of the optimizer's parameters."""

    micro: Sequence
    accumulated: Sequence
    # Their squared norms when the training step already took them (the CPU host buffer,
    # mindmon.kernels.stats.MicroStepNorms), else None.
    squared_norms: Optional[Any] = None


@dataclass
class StepEvent:
    """The base of every event. `PHASE`: the phase of the step that begins when it happens
    (mindmon.core.progress); None: it does not move the step to another phase."""

    at: float = field(default=0.0, init=False, compare=False)
    mindmon_seconds: float = field(default=0.0, init=False, compare=False)
    PHASE = None  # type: Optional[str]


@dataclass
class StepBegin(StepEvent):
    """The step's first micro-batch is about to run (cumulative counters are read here)."""

    PHASE = FORWARD_BACKWARD


@dataclass
class MicroBatchLoss(StepEvent):
    """Micro-batch `micro_step`'s loss, not divided by K (a scalar Tensor or float)."""

    micro_step: int = 0
    loss: Any = None


@dataclass
class MicroBatchGradients(StepEvent):
    """Micro-batch `micro_step`'s gradients, its own and accumulated so far."""

    micro_step: int = 0
    gradients: Optional[GradientSnapshot] = None


@dataclass
class MicroBatchEnd(StepEvent):
    """Micro-batch `micro_step`'s forward and backward are done. `samples` and `tokens`: its size when the
    loop knows it (the leading dimension of its columns, and that times the second one of a 2-d first column)."""

    micro_step: int = 0
    samples: Optional[int] = None
    tokens: Optional[int] = None
    PHASE = FORWARD_BACKWARD


@dataclass
class LossComponents(StepEvent):
    """The parts of micro-batch `micro_step`'s loss, as the loop hands them ({name: value}); None: ask
    the model (mindmon.features.loss_components)."""

    micro_step: Optional[int] = None   # None: the next one
    components: Optional[Dict[str, Any]] = None


@dataclass
class ReduceBegin(StepEvent):
    """The step's computing is done; the gradients now wait for the collective over the ranks."""

    PHASE = REDUCE


@dataclass
class GradientsReduced(StepEvent):
    """The gradients the optimizer will get, before clipping: the data-parallel mean on several ranks;
    None on one rank, where they are the accumulated ones of the last MicroBatchGradients."""

    gradients: Optional[Sequence] = None
    PHASE = UPDATE


@dataclass
class MicroBatchLosses(StepEvent):
    """Pipeline parallelism: every micro-batch's loss, known only once the last stage has sent them."""

    losses: Sequence = ()


@dataclass
class UpdateDone(StepEvent):
    """The optimizer's update is applied, or skipped. `loss_scale`: what holds the loss scale (a
    mindspore.amp scaler, a loss-scale manager, a TrainOneStepWithLossScaleCell) or None;
    `overflow`: the gradients were not finite (bool or a bool Tensor; None: not told, which the loss_scale
    monitor refuses); `skipped`: None means the same as `overflow`."""

    grad_norm: Optional[float] = None
    overflow: Any = None
    skipped: Optional[bool] = None
    loss_scale: Any = None
    PHASE = MONITOR


@dataclass
class StepLoss(StepEvent):
    """The step's loss: the mean over its micro-batches (and over the data-parallel ranks)."""

    loss: Any = None


@dataclass
class StepEnd(StepEvent):
    """Step `step` is over; the monitors collect next. `monitor_seconds`: mindmon's own time since the
    previous StepEnd (writing the previous step's records, and every event and record call since)."""

    step: int = 0
    monitor_seconds: float = 0.0
    max_steps: Optional[int] = None   # the run's last step, when the loop told the group


@dataclass
class StepWritten(StepEvent):
    """Step `step`'s records are in every output; the loop goes on to fetch the next batch."""

    step: int = 0
    PHASE = DATA


def _micro_step(context) -> int:
    return int((context or {}).get("micro_step", 0))


def from_record(key: str, value=None, context: Optional[dict] = None) -> Optional[StepEvent]:
    """The event a `record(key, value, context)` call of the MindFormers monitor protocol stands for;
    None for a key that is not one of the step's (a feature's hooks handing data to their own monitor)."""
    if key == "local_loss":
        return MicroBatchLoss(_micro_step(context), value)
    if key == "local_norm":
        return MicroBatchGradients(_micro_step(context), value)
    if key == "device_loss":
        return StepLoss(value)
    if key == "device_norm":
        return GradientsReduced(value)
    if key == "moe_tpe_step_begin":
        return StepBegin()
    if key == "moe_tpe":
        return MicroBatchEnd(_micro_step(context))
    if key == "loss_components":
        return LossComponents((context or {}).get("micro_step"), value)
    if key == "loss_scale":
        context = context or {}
        return UpdateDone(overflow=context.get("overflow"), skipped=context.get("skipped"), loss_scale=value)
    return None
