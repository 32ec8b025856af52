"""Hooks around one optimizer instance's update call, for every capability that reads state before or
after the update (tensor statistics, the collectives' log-only stop)."""
from typing import List

from mindmon.config import ConfigError


def hook_optimizer_calls(optimizer, before, after) -> List:
    """Hooks on this optimizer instance only: a Cell's forward pre-hook and hook, or, for a plain object
    with `step()` (a Megatron-style wrapper), an instance attribute `step` wrapping the bound method.
    Returns handles whose `remove()` detaches."""
    if hasattr(optimizer, "register_forward_pre_hook"):
        return [optimizer.register_forward_pre_hook(before), optimizer.register_forward_hook(after)]
    if callable(getattr(optimizer, "step", None)):
        return [WrappedStep(optimizer, before, after)]
    raise ConfigError(f"optimizer: got {type(optimizer).__name__}; allowed: a MindSpore optimizer Cell, or an "
                      f"object whose step() runs the update")


class WrappedStep:
    """`optimizer.step` replaced on the instance (never on its class) by one that calls the hooks around it."""

    def __init__(self, optimizer, before, after):
        self.optimizer = optimizer
        self.had_own = "step" in vars(optimizer)
        self.original = optimizer.step

        def step(*args, **kwargs):
            before(optimizer, args)
            output = self.original(*args, **kwargs)
            after(optimizer, args, output)
            return output

        optimizer.step = step

    def remove(self) -> None:
        if self.had_own:
            self.optimizer.step = self.original
        else:
            del self.optimizer.step
