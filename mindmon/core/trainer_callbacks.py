"""The MindFormers TrainerCallback events, without importing MindFormers (the core must not), and the
callback that flushes a MonitorGroup at every step end. Features that need a trainer callback subclass
`TrainerCallback`; `mindmon.callbacks` is their public face."""


class TrainerCallback:
    """Every event is a no-op; MindFormers' CallbackHandler calls them by name with
    `(args, state, **kwargs)`, kwargs carrying model, optimizer, lr_scheduler, datasets and, at
    step end, `loss` and `grad_norm`."""

    def on_begin(self, args, state, **kwargs):
        pass

    def on_end(self, args, state, **kwargs):
        pass

    def on_train_begin(self, args, state, **kwargs):
        pass

    def on_train_end(self, args, state, **kwargs):
        pass

    def on_epoch_begin(self, args, state, **kwargs):
        pass

    def on_epoch_end(self, args, state, **kwargs):
        pass

    def on_step_begin(self, args, state, **kwargs):
        pass

    def on_step_end(self, args, state, **kwargs):
        pass


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
        """The trainer hands over the step's loss, the global grad norm before clipping and its
        lr_scheduler; the learning rate recorded is `lr_scheduler(step)`, the value MindFormers'
        LossCallback prints."""
        scheduler = kwargs.get("lr_scheduler")
        learning_rate = None
        if callable(scheduler):
            try:
                learning_rate = scheduler(state.global_step)
            except Exception:  # a scheduler that cannot be asked must not stop training
                self.group.logger.exception("mindmon: could not read the learning rate; training goes on")
        self.group.flush(state.global_step, loss=kwargs.get("loss"), grad_norm=kwargs.get("grad_norm"),
                         learning_rate=learning_rate)
        if self.group.should_stop():   # an alert's stop_on_anomaly: the trainer's loop ends after this step
            state.max_steps = state.global_step

    def on_train_end(self, args, state, **kwargs):
        self.group.close()
