"""The Trainer's `monitor` on MindFormers 2.x: mindmon's MonitorGroup, as that Trainer's loop calls it.

The 2.x loop speaks the group's record protocol (`reset`, `record(key, value, context)`, `should_record`,
`active`) and the group takes those calls as they are. It also flushes its monitor itself (2.0 through its
MonitorCallback, `flush(step=)`; 2.1 from the loop, `setup(config, state)`, `flush(step)`), without the
step's loss, grad norm and learning rate: mindmon's MonitorCallback does those calls with them, once per
step, so here they do nothing.
"""


class LoopMonitorView:
    """`trainer.monitor` on 2.x; `group` is the run's MonitorGroup.

    Example:
        trainer.monitor = LoopMonitorView(run.group)
        trainer.monitor.record("local_loss", loss, {"micro_step": 0})   # -> run.group.record(...)
    """

    def __init__(self, group):
        self.group = group

    @property
    def active(self) -> bool:
        return self.group.active

    def should_record(self, key: str) -> bool:
        return self.group.should_record(key)

    def reset(self) -> None:
        self.group.reset()

    def record(self, key: str, value=None, context=None) -> None:
        self.group.record(key, value, context)

    def setup(self, *args, **kwargs) -> None:
        """The loop's; mindmon's MonitorCallback opens the group at train begin."""

    def flush(self, *args, **kwargs) -> None:
        """The loop's or MindFormers' MonitorCallback's; mindmon's MonitorCallback flushes with the step's values."""

    def set_model(self, model) -> None:
        """The monitors were told where to look when they were built."""

    def close(self) -> None:
        self.group.close()
