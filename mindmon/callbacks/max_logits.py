"""MaxLogitsMonitor: the max attention logit per layer and head (seed 000, section 1.3)."""
import logging
from typing import Dict, List

import numpy as np

from ..config import check_step_interval
from ..distributed import DataParallel
from ..records import MAX_ATTENTION_LOGIT, Record
from .base import TrainerCallback


def _four_digits(value: float) -> str:
    return f"{value:.4g}"


class MaxLogitsMonitor(TrainerCallback):
    """Every `step_interval` steps, logs the model's running per-head max of QK^T/sqrt(d) per layer,
    then its mean and max over all heads of all layers; resets the running max at every step end,
    logged or not, so each step starts clean.

    The model provides `get_max_attention_logit() -> {name: Tensor[num_heads]}` and
    `reset_max_attention_logit()` (the demo model does). With MindFormers, register it in the YAML:

        callbacks:
          - type: MaxLogitsMonitor
            step_interval: 1

    Lines: `step:[    2/   10] max_attention_logit/<name>: [1.5, 12.25]` (4 significant digits),
    `step:[    2/   10] max_attention_logit/mean: 4.219`, `step:[    2/   10] max_attention_logit/max: 12.25`.
    """

    def __init__(self, step_interval: int = 1, logger: logging.Logger = None):
        self.step_interval = check_step_interval(step_interval)
        self.logger = logger or logging.getLogger("mindmon")
        self.group = None  # set by the MindFormers integration: per-head values also go to the JSONL
        self.rank = 0
        self.data_parallel = None  # a DataParallel: values are the max over its ranks (default: the world)

    def on_train_begin(self, args, state, **kwargs):
        model = kwargs.get("model")
        if model is not None and hasattr(model, "track_max_attention_logit"):
            model.track_max_attention_logit = True
        if model is not None and not hasattr(model, "get_max_attention_logit"):
            self.logger.warning(f"mindmon: MaxLogitsMonitor: {type(model).__name__} has no "
                                f"get_max_attention_logit()/reset_max_attention_logit(); nothing will be logged")

    def on_step_end(self, args, state, **kwargs):
        model = kwargs.get("model")
        if model is None or not hasattr(model, "get_max_attention_logit"):
            return
        try:
            if state.global_step % self.step_interval == 0:
                values = {k: v.asnumpy() for k, v in model.get_max_attention_logit().items()}
                self._report(state, self._max_over_ranks(values, kwargs.get("data_parallel_group")))
        except Exception:
            self.logger.exception("mindmon: MaxLogitsMonitor could not read the max attention logits; "
                                  "training goes on")
        finally:
            model.reset_max_attention_logit()

    def _max_over_ranks(self, values: Dict[str, np.ndarray], group_name=None) -> Dict[str, np.ndarray]:
        """Every rank prints the max over the data-parallel group: one all-gather for all layers. A
        trainer that names its group in the step-end kwargs (`data_parallel_group`) is followed."""
        data_parallel = DataParallel(group_name) if group_name else self.data_parallel or DataParallel()
        if not data_parallel.active or not values:
            return values
        names = list(values)
        reduced = np.split(data_parallel.max(np.concatenate([values[n] for n in names])),
                           np.cumsum([values[n].size for n in names])[:-1])
        return dict(zip(names, reduced))

    def on_train_end(self, args, state, **kwargs):
        if self.group is not None:
            self.group.close()

    def _report(self, state, values: Dict[str, np.ndarray]) -> None:
        seen = {name: v for name, v in values.items() if np.isfinite(v).any()}  # -inf: nothing recorded
        if not seen:
            return
        prefix = f"step:[{state.global_step:5d}/{state.max_steps:5d}] {MAX_ATTENTION_LOGIT}/"
        for name, heads in seen.items():
            self.logger.info(f"{prefix}{name}: [{', '.join(_four_digits(v) for v in heads)}]")
        every_head = np.concatenate(list(seen.values()))
        self.logger.info(f"{prefix}mean: {_four_digits(every_head.mean())}")
        self.logger.info(f"{prefix}max: {_four_digits(every_head.max())}")
        if self.group is not None:
            self.group.write(self._records(state.global_step, seen))

    def _records(self, step: int, values: Dict[str, np.ndarray]) -> List[Record]:
        return [Record(step, None, self.rank, MAX_ATTENTION_LOGIT, name, [float(v) for v in heads])
                for name, heads in values.items()]
