"""The MindFormers TrainerCallback events, without importing MindFormers (the core must not)."""


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
