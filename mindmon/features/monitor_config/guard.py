"""The checks of monitor_config that act on training: the global-norm spike check, the NaN check
(`check_for_nan_in_loss_and_grad`) and `print_struct`.

The training step asks `should_skip_update(grad_norm)` before every optimizer update and the trainer
callback asks `should_stop()` after every step's records are written. Both decisions use only the
global gradient norm of the data-parallel mean and the mean loss over the ranks, which every rank
holds identically, so every rank skips or stops at the same step with no extra communication.

    spike      global norm >= global_norm_spike_threshold: the update is skipped (the step's data
               does not reach the weights) and the step counts as a spike; a step below the threshold
               resets the count; global_norm_spike_count_threshold consecutive spikes stop training
               after that step.
    NaN check  a NaN/Inf global norm or step loss: the update is skipped (as always) and training stops
               after that step.
    print_struct  the first step's update is skipped, the trainable parameter names are logged, and
               training stops after the step.
"""
import logging
import math
from typing import List, Optional, Sequence

from mindmon.core.engine import Monitor
from mindmon.core.events import StepLoss
from mindmon.core.records import Record
from mindmon.kernels.stats import to_float
from mindmon.features.monitor_config.monitors import GLOBAL_NORM_SPIKES, STEP_LEVEL_NAME


class StepGuard(Monitor):
    EVENTS = (StepLoss,)

    def __init__(self, section, parameter_names: Sequence[str] = (), rank: int = 0,
                 logger: Optional[logging.Logger] = None):
        self.spikes = section.checks_spikes
        self.threshold = section.global_norm_spike_threshold
        self.count_threshold = section.global_norm_spike_count_threshold
        self.check_nan = section.check_for_nan_in_loss_and_grad
        self.print_struct = section.monitor_on and section.print_struct
        self.parameter_names = list(parameter_names)
        self.rank = rank
        self.logger = logger or logging.getLogger("mindmon")
        self.consecutive = 0
        self.stop_reason: Optional[str] = None
        self.stopped = False
        self._grad_norm: Optional[float] = None
        self._loss = None

    def reset(self) -> None:
        self._grad_norm, self._loss = None, None

    def on_event(self, event) -> None:
        self._loss = event.loss

    def should_skip_update(self, grad_norm) -> bool:
        self._grad_norm = float(grad_norm) if grad_norm is not None else math.nan
        if self.print_struct:
            return True
        if not math.isfinite(self._grad_norm):
            return True
        return self.spikes and self._grad_norm >= self.threshold

    def collect(self, step: int) -> List[Record]:
        if self.print_struct:
            for name in self.parameter_names:
                self.logger.info(name)
            self.stop_reason = f"print_struct: the {len(self.parameter_names)} trainable parameter names are logged"
            return []
        self._check_nan(step)
        if not self.spikes or self._grad_norm is None:
            return []
        self._count_spike(step)
        return [Record(step, None, self.rank, GLOBAL_NORM_SPIKES, STEP_LEVEL_NAME, float(self.consecutive))]

    def _check_nan(self, step: int) -> None:
        if not self.check_nan or self.stop_reason is not None:
            return
        loss = to_float(self._loss) if self._loss is not None else 0.0
        for label, value in (("loss", loss), ("global_norm", self._grad_norm)):
            if value is not None and not math.isfinite(value):
                self.stop_reason = (f"check_for_nan_in_loss_and_grad: {label} is {value} at step {step}; the update "
                                    f"was skipped")
                return

    def _count_spike(self, step: int) -> None:
        if self._grad_norm is None or not self._grad_norm >= self.threshold:
            self.consecutive = 0
            return
        self.consecutive += 1
        message = (f"global norm {self._grad_norm} of step {step} has been {self.consecutive} consecutive time(s) "
                   f"greater than or equal to threshold {self.threshold}")
        if self.consecutive >= self.count_threshold:
            self.stop_reason = f"{message} (global_norm_spike_count_threshold {self.count_threshold})"
        else:
            self.logger.warning("mindmon: %s; the update of this step is skipped", message)

    def should_stop(self) -> bool:
        if self.stop_reason is not None and not self.stopped:
            self.stopped = True
            self.logger.error("mindmon: stopping training after this step: %s", self.stop_reason)
        return self.stopped

