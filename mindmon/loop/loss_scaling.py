"""The loss scale in force, read from whatever holds it in a MindSpore loop.

MindSpore keeps the current scale in different places depending on the API:

    mindspore.amp.DynamicLossScaler / StaticLossScaler    its `scale_value` Parameter (adjust() updates it)
    mindspore.nn.TrainOneStepWithLossScaleCell            its `scale_sense` Parameter (its update cell
                                                          writes the new scale into it)
    mindspore.amp.DynamicLossScaleManager /               get_loss_scale(): the manager's own number, which
    FixedLossScaleManager                                 its update_loss_scale(overflow) keeps (Model's
                                                          non-sink loop given the manager, and
                                                          AccumulatingTrainStep, call it per step)
    mindspore.nn.FixedLossScaleUpdateCell                 get_loss_scale(): the scale never changes
    a Parameter, Tensor or number                         itself (the Parameter a loop hands to a
                                                          DynamicLossScaleUpdateCell with `overflow`)

A DynamicLossScaleUpdateCell is refused: its get_loss_scale() is the initial scale for ever, the
current one lives in the Parameter the loop passes to it. So does a manager's update cell
(`get_update_cell()` builds a new one at each call): where a Model built a TrainOneStepWithLossScaleCell
from it, the scale is that cell's `scale_sense` (`loss_scale_cell`).
"""
from typing import Optional

from mindmon.kernels.stats import to_float


class ManagerScaler:
    """A mindspore.amp LossScaleManager in the scaler contract AccumulatingTrainStep uses (scale, unscale,
    adjust). The manager keeps the scale: adjust() is its update_loss_scale(overflow), once per step, as
    mindspore.train.Model's loop calls it."""

    def __init__(self, manager):
        self.manager = manager

    def _times(self, value, factor: float):
        from mindspore import Tensor

        return value * Tensor(factor, value.dtype)

    def scale(self, loss):
        return self._times(loss, float(self.manager.get_loss_scale()))

    def unscale(self, grads) -> tuple:
        inverse = 1.0 / float(self.manager.get_loss_scale())
        return tuple(self._times(grad, inverse) for grad in grads)

    def adjust(self, finite) -> None:
        self.manager.update_loss_scale(not bool(to_float(finite)))


def as_loss_scaler(scaler):
    """A LossScaleManager wrapped as a scaler; anything else as it is."""
    from mindspore import amp

    return ManagerScaler(scaler) if isinstance(scaler, amp.LossScaleManager) else scaler


def loss_scale_cell(network):
    """The TrainOneStepWithLossScaleCell that is `network` or lies inside it (the one mindspore.train.Model
    builds for `loss_scale_manager=`, MindFormers' subclasses of it), or None."""
    from mindspore import nn

    if isinstance(network, nn.TrainOneStepWithLossScaleCell):
        return network
    cells = network.cells_and_names() if isinstance(network, nn.Cell) else ()
    return next((cell for _, cell in cells if isinstance(cell, nn.TrainOneStepWithLossScaleCell)), None)


def scale_of(source) -> Optional[float]:
    """The current loss scale held by `source` (None: no scaler, so no scale is written)."""
    if source is None:
        return None
    from mindspore import Tensor, amp, nn

    if isinstance(source, ManagerScaler):
        source = source.manager
    if isinstance(source, amp.LossScaler):
        return to_float(source.scale_value)
    if isinstance(source, amp.LossScaleManager):
        return float(source.get_loss_scale())
    if isinstance(source, nn.TrainOneStepWithLossScaleCell):
        return to_float(source.scale_sense)
    if isinstance(source, nn.FixedLossScaleUpdateCell):
        return float(source.get_loss_scale())
    if isinstance(source, nn.DynamicLossScaleUpdateCell):
        raise TypeError("loss_scale: a DynamicLossScaleUpdateCell's get_loss_scale() is its initial scale; "
                        "hand in the loss-scale Parameter passed to it (or the TrainOneStepWithLossScaleCell)")
    if isinstance(source, (Tensor, int, float)) and not isinstance(source, bool):
        return to_float(source)
    raise TypeError(f"loss_scale: got {type(source).__module__}.{type(source).__name__}; allowed: a "
                    f"mindspore.amp loss scaler or loss-scale manager, a TrainOneStepWithLossScaleCell, a "
                    f"FixedLossScaleUpdateCell, the loss-scale Parameter or Tensor, a number, or None")
