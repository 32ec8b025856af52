"""LossComponentsMonitor: the parts of the model's loss, per micro-batch and per step (docs/semantics.md,
"Loss components").

A model exposes them (the protocol, as `get_max_attention_logit` for the max logit):

    def get_loss_components(self) -> Dict[str, Tensor]:   # the last forward's parts, scalars, by name
        return {"lm loss": ..., "load_balancing_loss": ..., "mtp_1 loss": ...}

and `AccumulatingTrainStep` reads them after every micro-batch. A plain loop hands them in instead:

    group.emit(LossComponents(k, {"lm loss": lm, "z_loss": z}))
    group.emit(LossComponents(k))   # no components: ask the model
(or, in the MindFormers monitor protocol, `group.record("loss_components", {...} or None, {"micro_step": k})`).
"""
from typing import Dict, List, Optional

import numpy as np

from mindmon.core.engine import NO_CROSS_RANK, CrossRankPayload, CrossRankSizes, Monitor
from mindmon.core.events import LossComponents, MicroBatchEnd
from mindmon.kernels.stats import to_float
from mindmon.core.records import LOSS_COMPONENT, LOSS_COMPONENT_STEP, Record


class LossComponentsMonitor(Monitor):
    EVENTS = (MicroBatchEnd, LossComponents)

    def __init__(self, model, rank: int, max_components: int = 16, cross_rank: bool = False):
        self.model = model
        self.rank = rank
        self.max_components = max_components
        self.summed_over_ranks = cross_rank
        self.names: List[str] = []        # in the order first seen: the data-parallel sum's slots
        self._handed_in = False           # the loop hands the components in: the model is not asked
        self._micro: Dict[int, dict] = {}
        self._sums: Optional[np.ndarray] = None

    def reset(self) -> None:
        self._micro, self._sums = {}, None

    def on_event(self, event) -> None:
        """A `LossComponents` hands them in (None: ask the model); a `MicroBatchEnd` asks the model unless
        the loop has handed them in itself."""
        if isinstance(event, LossComponents) and event.components is not None:
            self._handed_in = True
            components = event.components
        elif isinstance(event, MicroBatchEnd) and self._handed_in:
            return
        else:
            components = self._from_model()
        if not components:
            return
        micro_step = len(self._micro) if event.micro_step is None else event.micro_step
        for name in components:
            if name not in self.names:
                self._add_name(name)
        self._micro[micro_step] = dict(components)   # tensors: read at step end, one host read each

    def _from_model(self):
        read = getattr(self.model, "get_loss_components", None)
        if self.model is None:
            raise TypeError("loss_components: no model was given (model=) and the loop handed in no components")
        if read is None:
            raise TypeError(f"loss_components: the model ({type(self.model).__name__}) has no "
                            f"get_loss_components(); hand the components in with group.record(\"loss_components\", "
                            f"{{name: value}}, {{\"micro_step\": k}})")
        return read()

    def _add_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"loss_components: a component's name must be a non-empty str, got {name!r}")
        if len(self.names) == self.max_components:
            raise ValueError(f"loss_components: more than monitor.loss_components.max_components = "
                             f"{self.max_components} components ({self.names + [name]}); raise it")
        self.names.append(name)

    def _host_values(self) -> Dict[int, Dict[str, float]]:
        return {k: {name: to_float(v) for name, v in parts.items()} for k, parts in sorted(self._micro.items())}

    def _local_sums(self, values: Dict[int, Dict[str, float]]) -> np.ndarray:
        """Row 0: each component's sum over the micro-batches that had it; row 1: their count."""
        sums = np.zeros((2, self.max_components), np.float64)
        for parts in values.values():
            for name, value in parts.items():
                sums[0, self.names.index(name)] += value
                sums[1, self.names.index(name)] += 1
        return sums

    # Each component's sum and count over the data-parallel ranks, in the gradients' all-reduce.
    def cross_rank_sizes(self, num_micro_steps: int) -> CrossRankSizes:
        return CrossRankSizes(data_parallel=2 * self.max_components) if self.summed_over_ranks else NO_CROSS_RANK

    def cross_rank(self, num_micro_steps: int) -> Optional[CrossRankPayload]:
        if not self.summed_over_ranks:
            return None
        return CrossRankPayload(data_parallel=self._local_sums(self._host_values()).reshape(-1))

    def receive_cross_rank(self, summed: CrossRankPayload) -> None:
        self._sums = summed.data_parallel.reshape(2, self.max_components)

    def collect(self, step: int) -> List[Record]:
        values = self._host_values()
        sums = self._sums if self._sums is not None else self._local_sums(values)
        self._micro, self._sums = {}, None
        records = [Record(step, k, self.rank, LOSS_COMPONENT, name, value)
                   for k, parts in values.items() for name, value in parts.items()]
        return records + [Record(step, None, self.rank, LOSS_COMPONENT_STEP, name, float(total / count))
                          for name, total, count in zip(self.names, sums[0], sums[1]) if count > 0]
