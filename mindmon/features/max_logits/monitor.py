"""The max attention logit per layer and head, read from the model at step end (docs/semantics.md).

The model keeps a running per-head max of QK^T/sqrt(d) over the step's micro-steps and exposes
`get_max_attention_logit() -> {name: Tensor[num_heads]}` and `reset_max_attention_logit()` (the demo
model does; `mindmon.probes.attach_max_logit_probes` adds them to a model that does not).
"""
import logging
from typing import Dict, List, Optional

import numpy as np

from mindmon.features.max_logits.config import check_step_interval
from mindmon.parallel.data_parallel import DataParallel
from mindmon.core.engine import Monitor
from mindmon.core.records import MAX_ATTENTION_LOGIT, MAX_ATTENTION_LOGIT_MAX, MAX_ATTENTION_LOGIT_MEAN, Record


class MaxAttentionLogitMonitor(Monitor):
    """Every `step_interval` steps: `max_attention_logit` per layer (a list, one value per head), then
    `max_attention_logit_mean` and `max_attention_logit_max` over every head of every layer (name
    "all"). The running max is reset at every step end, collected or not, so each step starts clean.
    With a data-parallel group, every value is the max over its ranks (one all-gather per collected step).

    Example:
        monitor = MaxAttentionLogitMonitor(model, step_interval=1)
        records = monitor.collect(step=1)
    """

    def __init__(self, model, step_interval: int = 1, rank: int = 0, data_parallel: Optional[DataParallel] = None,
                 logger: Optional[logging.Logger] = None, layout=None, enable_logging: bool = True):
        self.step_interval = check_step_interval(step_interval)
        self.enable_logging = enable_logging   # False: the running max is only reset, every step
        self.rank = rank
        self.data_parallel = data_parallel   # None: this rank's values only
        # Heads split over tensor-parallel ranks: each layer's vector is every rank's heads in rank order.
        tensor_parallel = layout.groups.get("tp") if layout is not None else None
        self.tensor_parallel = tensor_parallel if tensor_parallel is not None and tensor_parallel.active else None
        self.model = model if hasattr(model, "get_max_attention_logit") else None
        if self.model is None:
            (logger or logging.getLogger("mindmon")).warning(
                f"mindmon: MaxLogitsMonitor: {type(model).__name__} has no get_max_attention_logit()/"
                f"reset_max_attention_logit(); nothing will be logged (see mindmon.probes)")
        elif hasattr(model, "track_max_attention_logit"):
            model.track_max_attention_logit = True   # the model's own switch for its running max

    def collect(self, step: int) -> List[Record]:
        if self.model is None:
            return []
        try:
            if step % self.step_interval or not self.enable_logging:
                return []
            values = {name: v.asnumpy() for name, v in self.model.get_max_attention_logit().items()}
            return self._records(step, self._max_over_ranks(self._heads_of_every_rank(values)))
        finally:
            self.model.reset_max_attention_logit()

    def _heads_of_every_rank(self, values: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Tensor parallelism: rank t holds heads [t * h, (t + 1) * h) of each layer; one gather over the
        group puts them in head order (every rank of the group then holds the whole vector)."""
        if self.tensor_parallel is None or not values:
            return values
        names = list(values)
        sizes = [values[n].size for n in names]
        rows = self.tensor_parallel.gather(np.concatenate([values[n].reshape(-1) for n in names]))
        pieces = np.split(rows, np.cumsum(sizes)[:-1], axis=1)
        return {name: piece.reshape(-1) for name, piece in zip(names, pieces)}

    def _max_over_ranks(self, values: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        if self.data_parallel is None or not self.data_parallel.active or not values:
            return values
        names = list(values)
        reduced = np.split(self.data_parallel.max(np.concatenate([values[n] for n in names])),
                           np.cumsum([values[n].size for n in names])[:-1])
        return dict(zip(names, reduced))

    def _records(self, step: int, values: Dict[str, np.ndarray]) -> List[Record]:
        # -inf everywhere is the reset value: the layer ran no attention this step. NaN and +inf are
        # real (a diverging run) and are recorded as they are.
        seen = {name: heads for name, heads in values.items() if not np.all(np.isneginf(heads))}
        if not seen:
            return []
        records = [Record(step, None, self.rank, MAX_ATTENTION_LOGIT, name, [float(v) for v in heads])
                   for name, heads in seen.items()]
        every_head = np.concatenate(list(seen.values())).astype(np.float64)
        return records + [Record(step, None, self.rank, MAX_ATTENTION_LOGIT_MEAN, "all", float(every_head.mean())),
                          Record(step, None, self.rank, MAX_ATTENTION_LOGIT_MAX, "all", float(every_head.max()))]
