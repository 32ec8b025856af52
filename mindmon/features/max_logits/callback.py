"""MaxLogitsMonitor: the `callbacks:` entry that asks for the max attention logit per layer and head, and a
MindFormers trainer callback that does the job itself when no mindmon run takes it over."""
import logging
import sys
from typing import Dict, List, Optional

from mindmon.features.max_logits.config import check_enable_logging, check_step_interval
from mindmon.core.records import MAX_ATTENTION_LOGIT
from mindmon.core.trainer_callbacks import TrainerCallback

QK_CLIP_HEADS = "qk_clip_heads"


class MaxLogitsMonitor(TrainerCallback):
    """Registered under MindFormers' name, so the YAML stays what MindFormers users write:

        callbacks:
          - type: MaxLogitsMonitor
            step_interval: 1          # log every N steps
            enable_logging: True      # False: only reset the running max every step

    With mindmon attached to the Trainer, the integration reads these settings and builds a
    MaxAttentionLogitMonitor into the run's MonitorGroup (`collected_by_run` is then True and this callback
    stands aside); the values reach every sink like all other records (log lines, JSONL, TensorBoard). In a
    plain loop, put the same entry in the `callbacks` list given to `mindmon.build_group`
    (docs/plain-loop.md).

    Standing alone, as MindFormers' own callback: at every step end it reads the model's
    `get_max_attention_logit()`, logs on its interval

        step:[    2/   10] max_attention_logit/<layer>: [1.5, 12.25]
        step:[    2/   10] max_attention_logit/mean: 4.219
        step:[    2/   10] max_attention_logit/max: 12.25

    and calls `reset_max_attention_logit()` every step, logged or not. A model that exposes
    `qk_clip_threshold` (Muon's QK clip) also gets `max_attention_logit/qk_clip_heads: N`, the heads whose
    max logit exceeded it this step; `qk_clip_events` counts them over the run. The model may be a list of
    model chunks (MindFormers 2.x).

    Example:
        callback = MaxLogitsMonitor(step_interval=2)
        callback.on_step_end(None, state, model=model)   # state: global_step, max_steps
    """

    def __init__(self, step_interval: int = 1, enable_logging: bool = True,
                 logger: Optional[logging.Logger] = None):
        self.step_interval = check_step_interval(step_interval)
        self.enable_logging = check_enable_logging(enable_logging)
        self.logger = logger
        self.collected_by_run = False
        self.qk_clip_events = 0
        self._monitors: Dict[int, object] = {}

    def on_train_begin(self, args, state, **kwargs):
        if not self.collected_by_run:
            for model in _chunks(kwargs.get("model")):
                self._monitor_of(model)   # switches the model's tracking on before step 1

    def on_step_end(self, args, state, **kwargs):
        if self.collected_by_run:
            return
        step = getattr(state, "global_step", 0)
        for model in _chunks(kwargs.get("model")):
            if not self.enable_logging:
                if hasattr(model, "reset_max_attention_logit"):
                    model.reset_max_attention_logit()
                continue
            monitor = self._monitor_of(model)
            if monitor.model is not None:
                self._log(monitor.collect(step), model, getattr(state, "max_steps", None))

    def _monitor_of(self, model):
        from mindmon.features.max_logits.monitor import MaxAttentionLogitMonitor

        if id(model) not in self._monitors:
            self._monitors[id(model)] = MaxAttentionLogitMonitor(model, self.step_interval, logger=self._logger())
        return self._monitors[id(model)]

    def _log(self, records: List, model, max_steps: Optional[int]) -> None:
        from mindmon.formats.log_lines import format_lines, step_prefix

        logger = self._logger()
        for line in format_lines(records, max_steps):
            logger.info(line)
        threshold = getattr(model, "qk_clip_threshold", None)
        if records and threshold is not None:
            heads = sum(sum(v > threshold for v in r.value) for r in records if r.kind == MAX_ATTENTION_LOGIT)
            self.qk_clip_events += heads
            logger.info(f"{step_prefix(records[0].step, max_steps)}{MAX_ATTENTION_LOGIT}/{QK_CLIP_HEADS}: {heads}")

    def _logger(self) -> logging.Logger:
        """`logger`, else MindFormers' own when its Trainer has loaded it (never imported from here: the
        core imports no MindFormers), else the "mindmon" logger."""
        if self.logger is not None:
            return self.logger
        mindformers_logging = sys.modules.get("mindformers.tools.logger")
        return getattr(mindformers_logging, "logger", None) or logging.getLogger("mindmon")


class MaxLogitsReset(MaxLogitsMonitor):
    """Resets the model's running max every step and logs nothing (MindFormers' name for it)."""

    def __init__(self, logger: Optional[logging.Logger] = None):
        super().__init__(step_interval=1, enable_logging=False, logger=logger)


def _chunks(model) -> list:
    if model is None:
        return []
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    return [_unwrapped(m) for m in models if m is not None]


def _unwrapped(model):
    """A wrapper cell (AMP, FSDP) keeps the model as `network`."""
    while hasattr(model, "network") and not hasattr(model, "get_max_attention_logit"):
        model = model.network
    return model
