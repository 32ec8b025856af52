"""MonitorCallback: flushes the MonitorGroup at every step end."""
from typing import List, Optional

from ..records import GRAD_NORM, LEARNING_RATE, LOSS, SAMPLES, Record
from .base import TrainerCallback


def _to_float(value) -> Optional[float]:
    if value is None:
        return None
    return float(value.asnumpy()) if hasattr(value, "asnumpy") else float(value)


def step_records(state, rank: int, **kwargs) -> List[Record]:
    """The values the trainer hands to every callback at step end: the step's loss, the global
    gradient norm before clipping, the learning rate (`lr_scheduler(step)`, the value MindFormers'
    LossCallback prints) and the samples consumed so far (`step x global_batch_size`)."""
    step = state.global_step
    values = {LOSS: ("loss", _to_float(kwargs.get("loss"))),
              GRAD_NORM: ("global", _to_float(kwargs.get("grad_norm")))}
    scheduler = kwargs.get("lr_scheduler")
    if callable(scheduler):
        values[LEARNING_RATE] = ("lr", _to_float(scheduler(step)))
    if getattr(state, "global_batch_size", 0):
        values[SAMPLES] = ("consumed", float(step * state.global_batch_size))
    return [Record(step, None, rank, kind, name, value) for kind, (name, value) in values.items()
            if value is not None]


class MonitorCallback(TrainerCallback):
    """Writes what the group collected during the step (log lines, JSONL, TensorBoard) once the
    step is over, with the trainer's own step values (loss, grad norm, lr, samples).

    Example:
        group = build_group(config, parameter_names=[p.name for p in optimizer.parameters])
        trainer.callback_handler.add_callback(MonitorCallback(group))
    """

    def __init__(self, group):
        self.group = group

    def on_train_begin(self, args, state, **kwargs):
        self.group.setup(start_step=getattr(state, "global_step", 0),
                         global_batch_size=getattr(state, "global_batch_size", 0) or None,
                         max_steps=getattr(state, "max_steps", None))

    def on_step_end(self, args, state, **kwargs):
        try:
            self.group.write(step_records(state, self.group.rank, **kwargs))
        except Exception:  # a value the trainer hands over in an unexpected shape must not stop training
            self.group.logger.exception("mindmon: could not record the step's loss/grad norm/lr; training goes on")
        self.group.flush(state.global_step)
        if self.group.should_stop():   # an alert's stop_on_anomaly: the trainer's loop ends after this step
            state.max_steps = state.global_step

    def on_train_end(self, args, state, **kwargs):
        self.group.close()
