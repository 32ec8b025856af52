"""Opt-in actions the training loop asks for: stop after a step with an anomaly, skip the
optimizer update of a step whose gradients are not finite. With several data-parallel ranks both
decisions are taken together (one tiny SUM all-reduce of a flag), so every rank stops, or skips,
at the same step; every rank must then call the method at every step.

Example (a plain loop; the sink notes its anomalies into `actions`):
    actions = AlertActions(stop_on_anomaly=True, skip_nonfinite_update=True)
    sink = AlertSink(config, output_dir, actions=actions)
    for step, batch in enumerate(batches, start=1):
        ...                                   # forward/backward, grad_norm of the (reduced) gradients
        if not actions.should_skip_update(grad_norm):
            optimizer(grads)
        sink.write(records); sink.flush()     # the step's records are written first
        if actions.should_stop():
            break
"""
import logging
import math
from typing import Optional, Sequence


class AlertActions:
    def __init__(self, stop_on_anomaly: bool = False, skip_nonfinite_update: bool = False,
                 data_parallel=None, logger: Optional[logging.Logger] = None):
        self.stop_on_anomaly = stop_on_anomaly
        self.skip_nonfinite_update = skip_nonfinite_update
        self.data_parallel = data_parallel
        self.logger = logger or logging.getLogger("mindmon")
        self.reason: Optional[str] = None   # the first anomaly that asked for the stop
        self.stopped = False
        self.skipped_updates = 0

    @classmethod
    def from_config(cls, config, data_parallel=None, logger=None) -> "AlertActions":
        return cls(config.stop_on_anomaly, config.skip_nonfinite_update, data_parallel, logger)

    def note(self, anomalies: Sequence) -> None:
        """Called by AlertSink with the anomalies of each write."""
        if self.stop_on_anomaly and anomalies and self.reason is None:
            self.reason = anomalies[0].message

    def _any_rank(self, flag: bool) -> bool:
        if self.data_parallel is None or not self.data_parallel.active:
            return flag
        import numpy as np
        from mindspore import Tensor

        total = self.data_parallel.sum([Tensor(np.array([float(flag)], np.float32))])[0]
        return float(total.asnumpy()[0]) > 0

    def should_stop(self) -> bool:
        """After the step's records are written: True when this or any rank saw an anomaly."""
        if not self.stop_on_anomaly or self.stopped:
            return self.stopped
        self.stopped = self._any_rank(self.reason is not None)
        if self.stopped:
            self.logger.error("mindmon alerts: stopping training after this step (stop_on_anomaly): %s",
                              self.reason or "an anomaly on another rank")
        return self.stopped

    def should_skip_update(self, grad_norm) -> bool:
        """True when `skip_nonfinite_update` is on and the global gradient norm (None counts as not
        finite) is NaN/Inf on this or any rank."""
        if not self.skip_nonfinite_update:
            return False
        skip = self._any_rank(grad_norm is None or not math.isfinite(float(grad_norm)))
        if skip:
            self.skipped_updates += 1
            self.logger.warning("mindmon alerts: gradients not finite (global norm %s); optimizer update skipped",
                                grad_norm)
        return skip
