"""The loss scale in force, read from whatever holds it in a MindSpore loop.

MindSpore keeps the current scale in different places depending on the API:

    mindspore.amp.DynamicLossScaler / StaticLossScaler    its `scale_value` Parameter (adjust() updates it)
    mindspore.nn.TrainOneStepWithLossScaleCell            its `scale_sense` Parameter (its update cell
                                                          writes the new scale into it)
    mindspore.nn.FixedLossScaleUpdateCell                 get_loss_scale(): the scale never changes
    a Parameter, Tensor or number                         itself (the Parameter a loop hands to a
                                                          DynamicLossScaleUpdateCell with `overflow`)

A DynamicLossScaleUpdateCell is refused: its get_loss_scale() is the initial scale for ever, the
current one lives in the Parameter the loop passes to it.
"""
from typing import Optional

from mindmon.kernels.stats import to_float


def scale_of(source) -> Optional[float]:
    """The current loss scale held by `source` (None: no scaler, so no scale is written)."""
    if source is None:
        return None
    from mindspore import Tensor, amp, nn

    if isinstance(source, amp.LossScaler):
        return to_float(source.scale_value)
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
                    f"mindspore.amp loss scaler, a TrainOneStepWithLossScaleCell, a FixedLossScaleUpdateCell, "
                    f"the loss-scale Parameter or Tensor, a number, or None")
