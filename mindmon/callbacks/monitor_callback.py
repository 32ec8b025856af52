"""MonitorCallback: flushes the MonitorGroup at every step end."""
from .base import TrainerCallback


class MonitorCallback(TrainerCallback):
    """Writes what the group collected during the step (log lines, JSONL) once the step is over.

    Example:
        group = MonitorGroup(config.monitor, parameter_names=[p.name for p in optimizer.parameters])
        trainer.callback_handler.add_callback(MonitorCallback(group))
    """

    def __init__(self, group):
        self.group = group

    def on_train_begin(self, args, state, **kwargs):
        self.group.setup(start_step=getattr(state, "global_step", 0))

    def on_step_end(self, args, state, **kwargs):
        self.group.flush(state.global_step)

    def on_train_end(self, args, state, **kwargs):
        self.group.close()
