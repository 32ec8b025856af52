"""`monitor.train_state`: per-parameter gradient norms per micro-step, micro-batch and device losses.

Semantics (docs/semantics.md): micro-batch k contributes g_k = grad(loss_k / K); G_k = g_0 + ... + g_k is
the gradient accumulated so far and A_k = |G_k| per parameter.
    local_norm  at micro-step k = A_k - A_{k-1}   (A_{-1} = 0)
    device_norm                 = A_{K-1}         (the gradient the optimizer gets, before clipping;
                                                   with several ranks, the norm of the data-parallel mean)
    micro_norm  at micro-step k = |g_k|           (JSONL only; msprobe's per-micro-batch gradient)
    local_loss  at micro-step k = loss_k;  device_loss = mean_k loss_k
`device_norm` forces the collection of the norms it needs; each switch filters its own output.
"""
from typing import List, Optional, Sequence

import numpy as np

from mindmon.config import ConfigError
from mindmon.features.train_state.config import TrainStateConfig
from mindmon.core.engine import NO_CROSS_RANK, CrossRankPayload, CrossRankSizes, Monitor
from mindmon.core.events import GradientSnapshot, GradientsReduced, MicroBatchGradients, MicroBatchLoss, StepLoss
from mindmon.core.records import DEVICE_LOSS, DEVICE_NORM, LOCAL_LOSS, LOCAL_NORM, MICRO_NORM, Record
from mindmon.parallel.norms import ShardedNorms
from mindmon.kernels.stats import MicroStepNorms, SquaredNorms, to_float


class TrainStateMonitor(Monitor):
    """Collects `local_loss`, `local_norm`, `device_loss`, `device_norm` records for one step.

    Example:
        monitor = TrainStateMonitor(config, parameter_names, rank=0, on_host=True)
        monitor.on_event(MicroBatchLoss(0, loss))
        monitor.on_event(MicroBatchGradients(0, GradientSnapshot(grads, accumulated)))
        monitor.on_event(StepLoss(mean_loss))
        records = monitor.collect(step=1)
    """

    EVENTS = (MicroBatchLoss, MicroBatchGradients, StepLoss, GradientsReduced)

    def __init__(self, config: TrainStateConfig, parameter_names: Sequence[str], rank: int = 0,
                 on_host: bool = True, norms: Optional[SquaredNorms] = None, layout=None):
        self.config = config
        self.rank = rank
        _check_filters_match(config, parameter_names)
        want = [config.local_norm.matches(n) or config.device_norm.matches(n) for n in parameter_names]
        # Filters are applied once, here, not per call.
        self.indices = [i for i, wanted in enumerate(want) if wanted]
        self.names = [parameter_names[i] for i in self.indices]
        self._index_array = np.array(self.indices, dtype=np.int64)
        self.local_mask = np.array([config.local_norm.matches(n) for n in self.names], dtype=bool)
        self.device_mask = np.array([config.device_norm.matches(n) for n in self.names], dtype=bool)
        self.collects_norms = bool(self.indices)
        # `norms` lets a benchmark swap in another way of taking the same squared norms.
        self._norms = norms if norms is not None else SquaredNorms(on_host)
        # Model parallelism: the norms are of full parameters (shards' squared norms summed over tp/cp,
        # mindmon.parallel), written by the first rank of those groups only.
        self._shards = ShardedNorms(layout, self.names, self.indices, parameter_names) if ShardedNorms.needed(layout) else None
        self.writes_norms = layout is None or layout.writes_full_parameters
        # Only the events this configuration records from, so that the group's `should_record(key)` answers
        # per key, as the MindFormers protocol expects (only device_norm on: device_loss is not wanted).
        self.EVENTS = self.events_for(config, self.collects_norms)
        self.reset()

    @staticmethod
    def events_for(config: TrainStateConfig, collects_norms: bool) -> tuple:
        wanted = ((MicroBatchLoss, config.local_loss), (MicroBatchGradients, collects_norms),
                  (StepLoss, config.device_loss), (GradientsReduced, config.device_norm.enabled))
        return tuple(event for event, on in wanted if on)

    def reset(self) -> None:
        self._norms.clear()
        self._losses: List = []
        self._micro_steps: List[int] = []
        self._device_loss = None
        if self._shards is not None:
            self._shards.clear()

    def on_event(self, event) -> None:
        if isinstance(event, MicroBatchLoss):
            self._losses.append((event.micro_step, event.loss))
        elif isinstance(event, MicroBatchGradients) and self.collects_norms:
            self._add_norms(event.micro_step, event.gradients)
        elif isinstance(event, StepLoss):
            self._device_loss = event.loss
        elif isinstance(event, GradientsReduced) and event.gradients is not None and self.config.device_norm.enabled:
            # Several ranks: the gradient the optimizer gets is the data-parallel mean, not A_{K-1}.
            self._norms.add("reduced", [event.gradients[i] for i in self.indices])

    def _add_norms(self, micro_step: int, value: GradientSnapshot) -> None:
        self._micro_steps.append(micro_step)
        if value.squared_norms is not None:
            self._put_squared_norms(micro_step, value.squared_norms)
            return
        self._norms.add(("accumulated", micro_step), [value.accumulated[i] for i in self.indices])
        if self.config.local_norm.enabled and value.micro is value.accumulated:
            # Micro-step 0: the micro-batch's gradient is the accumulated one; read it once.
            self._norms.alias(("micro", micro_step), ("accumulated", micro_step))
        elif self.config.local_norm.enabled:
            self._norms.add(("micro", micro_step), [value.micro[i] for i in self.indices])

    def _put_squared_norms(self, micro_step: int, squared: MicroStepNorms) -> None:
        self._norms.put(("accumulated", micro_step), squared.accumulated[self._index_array])
        if self.config.local_norm.enabled:
            self._norms.put(("micro", micro_step), squared.micro[self._index_array])

    # Under tensor / context parallelism: the per-parameter squared norms summed over the shards.
    def cross_rank_sizes(self, num_micro_steps: int) -> CrossRankSizes:
        return CrossRankSizes(shards=self._shards.size(num_micro_steps)) if self._shards is not None \
            else NO_CROSS_RANK

    def cross_rank(self, num_micro_steps: int) -> Optional[CrossRankPayload]:
        if self._shards is None:
            return None
        return CrossRankPayload(shards=self._shards.current(num_micro_steps, self._norms.results(),
                                                            self._micro_steps, self.config.local_norm.enabled))

    def receive_cross_rank(self, summed: CrossRankPayload) -> None:
        if self._shards is not None:
            self._shards.receive(summed.shards)

    def collect(self, step: int) -> List[Record]:
        records = []
        if self.config.local_loss:
            records += [self._record(step, k, LOCAL_LOSS, "loss", to_float(v)) for k, v in self._losses]
        records += self._norm_records(step)
        if self.config.device_loss and self._device_loss is not None:
            records.append(self._record(step, None, DEVICE_LOSS, "loss", to_float(self._device_loss)))
        self.reset()
        return records

    def _norm_records(self, step: int) -> List[Record]:
        if not self._micro_steps or not self.writes_norms:
            return []
        squared = self._norms.results()
        if self._shards is not None:
            squared = self._shards.results(self._micro_steps, squared)
        records, previous = [], np.zeros(len(self.names))
        for k in self._micro_steps:
            accumulated = np.sqrt(squared[("accumulated", k)])
            if self.config.local_norm.enabled:
                records += self._masked_records(step, k, LOCAL_NORM, accumulated - previous, self.local_mask)
                records += self._masked_records(step, k, MICRO_NORM, np.sqrt(squared[("micro", k)]), self.local_mask)
            previous = accumulated
        if self.config.device_norm.enabled:
            device = np.sqrt(squared["reduced"]) if "reduced" in squared else previous
            records += self._masked_records(step, None, DEVICE_NORM, device, self.device_mask)
        return records

    def _masked_records(self, step, micro_step, kind, values: np.ndarray, mask: np.ndarray) -> List[Record]:
        """A record per parameter the mask keeps (names in order, values as Python floats)."""
        names = [name for name, keep in zip(self.names, mask) if keep]
        kept = np.asarray(values, dtype=np.float64)[mask].tolist()
        return Record.many(step, micro_step, self.rank, kind, names, kept)

    def _record(self, step, micro_step, kind, name, value) -> Record:
        return Record(step, micro_step, self.rank, kind, name, value)


def _check_filters_match(config: TrainStateConfig, parameter_names: Sequence[str]) -> None:
    """A substring that selects no parameter is almost always a typo: say so before step 1."""
    for key in ("local_norm", "device_norm"):
        for substring in getattr(config, key).substrings:
            if not any(substring in name for name in parameter_names):
                examples = ", ".join(list(parameter_names)[:4])
                raise ConfigError(f"monitor.train_state.{key}: {substring!r} matches no trainable parameter; "
                                  f"allowed: substrings of parameter names such as {examples}")
