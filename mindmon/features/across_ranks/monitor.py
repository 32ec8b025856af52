"""The per-rank values of a step laid out as one row per data-parallel rank, every row carried to every rank
inside the step's own packed SUM all-reduces (the `job` part of its CrossRankPayload), and summarised by rank 0.

MindSpore's CPU AllReduce sums only, so the row travels as a gather made of a sum: each rank sends a
(ranks x columns) buffer of zeros with its own row filled in; the sum is every rank's row, exactly (only
zeros are added to a value, so NaN and infinities stay). min, max and the extremes' ranks then come from
the rows, with no collective and no host sync of their own: the buffer joins the gradients' all-reduce,
and the summed rows reach the host once. The price is ranks x columns float32 values more in that
all-reduce (docs/performance.md). Norms travel squared and are rooted after the sum.

Under tensor or context parallelism a row is a data-parallel replica's: each of its ranks adds its shards'
squared norms, weighted as `ParallelLayout.norm_weight` counts every element once, and its first rank the
losses and token counts; the same rows then go on through the model-parallel groups' sums, so each row holds
the replica's full-parameter values.

Columns, in this order (docs/outputs.md, "Cross-rank summaries"):
    local_loss at k            loss_k of the rank                            (train_state.local_loss)
    device_loss                the rank's own mean of its K losses           (train_state.device_loss)
    micro_norm/<p> at k        ||g_k|| of the rank                           (train_state.local_norm)
    accumulated_norm/<p>       A_{K-1}, the rank's own accumulated gradient  (either norm filter)
    tokens_per_expert_step/<layer>/expert_<e>   the rank's own tokens in the step (moe_monitor)
"""
from typing import List, Optional, Sequence

import numpy as np

from mindmon.core.engine import NO_CROSS_RANK, CrossRankPayload, CrossRankSizes, Monitor
from mindmon.core.events import MicroBatchGradients, MicroBatchLoss, StepLoss
from mindmon.features.across_ranks.summaries import Column, summary_records
from mindmon.kernels.stats import SquaredNorms, to_float
from mindmon.parallel.norms import PER_PARAMETER_AXES
from mindmon.core.records import (ACROSS_RANKS, DEVICE_LOSS, LOCAL_LOSS, MICRO_NORM,
                             TOKENS_PER_EXPERT_STEP, Record)

ACCUMULATED_NORM = "accumulated_norm"


class AcrossRanksMonitor(Monitor):
    """Example (a plain loop; the factory builds it from `monitor.across_ranks: {enabled: true}`):
        monitor = AcrossRanksMonitor(train_state_config, parameter_names, DataParallel(), on_host=True)
        ... the train step records local_loss / local_norm / device_loss and packs `cross_rank(K)`
        records = monitor.collect(step)   # on the job's rank 0: across_ranks records
    """

    def __init__(self, train_state, parameter_names: Sequence[str], data_parallel, on_host: bool = True,
                 moe=None, rank: int = 0, layout=None):
        """`layout`: a mindmon.parallel.ParallelLayout with tensor or context parallelism (rows are then the
        data-parallel replicas'), or None."""
        self.size, self.dp_rank, self.rank = data_parallel.size, data_parallel.rank, rank
        self.layout = layout if layout is not None and layout.model_parallel else None
        first = self.layout is None or self.layout.writes_full_parameters
        self.writes = self.dp_rank == 0 and first   # the job's first rank
        self.parameter_names = list(parameter_names)
        self.on_host = on_host
        self.losses = bool(train_state and train_state.local_loss)
        self.device_loss = bool(train_state and train_state.device_loss)
        local = train_state.local_norm if train_state else None
        device = train_state.device_norm if train_state else None
        self.norm_indices = [i for i, n in enumerate(parameter_names)
                             if (local and local.matches(n)) or (device and device.matches(n))]
        self.micro_indices = [i for i in self.norm_indices if local and local.matches(parameter_names[i])]
        self.norm_names = [parameter_names[i] for i in self.norm_indices]
        self.micro_positions = np.array([self.norm_indices.index(i) for i in self.micro_indices], np.int64)
        self.moe = moe if moe is not None and moe.expert_parallel is None else None
        self.EVENTS = tuple(e for e, on in ((MicroBatchLoss, self.losses or self.device_loss),
                                            (MicroBatchGradients, bool(self.norm_indices)), (StepLoss, True)) if on)
        self._columns, self._weights = {}, {}
        self.reset()

    @property
    def summarises(self) -> bool:
        return bool(self.losses or self.device_loss or self.norm_indices or self.moe is not None)

    def reset(self) -> None:
        self._losses, self._micro, self._accumulated = [], [], None
        self._own_row, self._summed = None, None

    def on_event(self, event) -> None:
        if isinstance(event, MicroBatchLoss):
            self._losses.append(event.loss)
        elif isinstance(event, MicroBatchGradients):
            self._add_norms(event.gradients)
        elif isinstance(event, StepLoss) and self.size == 1 and self.layout is None:
            # One rank: the step's values are complete here, before the other monitors' collect.
            self._own_row = self._row(len(self._losses) or len(self._micro))

    def _add_norms(self, snapshot) -> None:
        if snapshot.squared_norms is not None:
            accumulated = snapshot.squared_norms.accumulated[self.norm_indices]
            micro = snapshot.squared_norms.micro
            micro = micro[self.micro_indices] if micro is not None and self.micro_indices else None
        else:
            accumulated = squared_norms([snapshot.accumulated[i] for i in self.norm_indices], self.on_host)
            micro = squared_norms([snapshot.micro[i] for i in self.micro_indices], self.on_host)
        self._accumulated = accumulated
        self._micro.append(micro)

    def columns(self, num_micro_steps: int) -> List[Column]:
        if num_micro_steps not in self._columns:
            self._columns[num_micro_steps] = self._layout(num_micro_steps)
        return self._columns[num_micro_steps]

    def _layout(self, num_micro_steps: int) -> List[Column]:
        steps = range(num_micro_steps)
        columns = [Column(k, LOCAL_LOSS) for k in steps] if self.losses else []
        columns += [Column(None, DEVICE_LOSS)] if self.device_loss else []
        columns += [Column(k, f"{MICRO_NORM}/{self.norm_names[p]}") for k in steps for p in self.micro_positions]
        columns += [Column(None, f"{ACCUMULATED_NORM}/{name}") for name in self.norm_names]
        for layer, cell in zip(self.moe.layers, self.moe.cells) if self.moe is not None else ():
            columns += [Column(None, f"{TOKENS_PER_EXPERT_STEP}/{layer.name}/expert_{e}")
                        for e in range(int(np.prod(cell.tokens_per_expert.shape)))]
        return columns

    def cross_rank_sizes(self, num_micro_steps: int) -> CrossRankSizes:
        if self.size == 1 and self.layout is None:
            return NO_CROSS_RANK
        return CrossRankSizes(job=self.size * len(self.columns(num_micro_steps)))

    def cross_rank(self, num_micro_steps: int) -> Optional[CrossRankPayload]:
        """The (ranks x columns) zeros with this rank's row filled in, flat: numpy on CPU, else a float32
        Tensor still on the device."""
        row = self._row(num_micro_steps)
        if row is None:
            return None
        width = len(self.columns(num_micro_steps))
        if self.layout is not None:
            row = row * (self.weights(num_micro_steps) if isinstance(row, np.ndarray)
                         else _tensor(self.weights(num_micro_steps)))
        if isinstance(row, np.ndarray):
            rows = np.zeros((self.size, width), np.float32)
            rows[self.dp_rank] = row
            return CrossRankPayload(job=rows.reshape(-1))
        from mindspore import mint
        import mindspore as ms

        before = mint.zeros(self.dp_rank * width, dtype=ms.float32)
        after = mint.zeros((self.size - self.dp_rank - 1) * width, dtype=ms.float32)
        return CrossRankPayload(job=mint.cat([before, row, after]))

    def receive_cross_rank(self, summed: CrossRankPayload) -> None:
        self._summed = summed.job if self.writes else None   # only rank 0 writes

    def weights(self, num_micro_steps: int) -> np.ndarray:
        """What this rank's row counts for in its replica's sum, per column: a norm column its parameter's
        `norm_weight` over tp and cp; the rest 1 on the replica's first rank, else 0. Read at the first step,
        once the train step has added the parameters' placements to the layout."""
        if num_micro_steps not in self._weights:
            per_parameter = self.layout.norm_weights(PER_PARAMETER_AXES, self.parameter_names)
            weight = {self.parameter_names[i]: per_parameter[i] for i in self.norm_indices}
            first = 1.0 if self.layout.writes_full_parameters else 0.0
            self._weights[num_micro_steps] = np.array(
                [weight[_parameter(c.name)] if _parameter(c.name) is not None else first
                 for c in self.columns(num_micro_steps)], np.float32)
        return self._weights[num_micro_steps]

    def _row(self, num_micro_steps: int):
        """This rank's values in column order: a float32 numpy array on CPU, else one float32 Tensor still
        on the device; None when the step did not record what the layout expects (the group sends zeros)."""
        pieces = []
        if self.losses or self.device_loss:
            if len(self._losses) != num_micro_steps:
                return None
            losses = np.array([to_float(v) for v in self._losses]) if self.on_host else _stack(self._losses)
            pieces += ([losses] if self.losses else []) + ([losses.mean().reshape(1)] if self.device_loss else [])
        if self.norm_indices:
            if len(self._micro) != num_micro_steps or self._accumulated is None:
                return None
            if self.micro_indices:
                pieces += list(self._micro)
            pieces.append(self._accumulated)
        if self.moe is not None:
            tokens = self.moe.step_tokens()
            if tokens is None:
                return None
            pieces.append(tokens)
        if self.on_host and all(isinstance(p, np.ndarray) for p in pieces):
            return np.concatenate([p.reshape(-1) for p in pieces]).astype(np.float32)
        return _concat(pieces)

    def collect(self, step: int) -> List[Record]:
        rows, num_micro_steps = None, len(self._losses) or len(self._micro)
        if self._summed is not None:
            rows = np.asarray(self._summed, np.float64).reshape(self.size, -1)
        elif self.size == 1 and self.layout is None and self._own_row is not None:
            own = self._own_row
            rows = np.asarray(own if isinstance(own, np.ndarray) else own.asnumpy(), np.float64).reshape(1, -1)
        self.reset()
        if rows is None or not self.writes:
            return []
        columns = self.columns(num_micro_steps)
        norms = np.array([_parameter(c.name) is not None for c in columns])
        rows[:, norms] = np.sqrt(rows[:, norms])   # they travelled squared
        return summary_records(step, self.rank, columns, rows)


def squared_norms(tensors: Sequence, on_host: bool):
    """The squared L2 norm of each tensor: a float64 array on the host, a float32 Tensor on the device
    (read with the summed rows, at step end)."""
    if not tensors:
        return None
    if on_host or isinstance(tensors[0], np.ndarray):
        norms = SquaredNorms(True)
        norms.add(ACROSS_RANKS, tensors)
        return norms.results()[ACROSS_RANKS]
    from mindspore import mint, ops

    return ops.stack([mint.sum(mint.square(t.float())) for t in tensors])


def _stack(values: Sequence):
    from mindspore import Tensor, ops
    import mindspore as ms

    tensors = [v if isinstance(v, Tensor) else Tensor(np.float32(v)) for v in values]
    return ops.stack([t.reshape(()).astype(ms.float32) for t in tensors])


def _parameter(column_name: str) -> Optional[str]:
    """The parameter a norm column is of, or None for a loss or token column."""
    for prefix in (MICRO_NORM + "/", ACCUMULATED_NORM + "/"):
        if column_name.startswith(prefix):
            return column_name[len(prefix):]
    return None


def _tensor(values: np.ndarray):
    from mindspore import Tensor

    return Tensor(values)


def _concat(pieces: Sequence):
    """One flat float32 Tensor of host arrays and device Tensors (host arrays are copied, not synced)."""
    from mindspore import Tensor, mint
    import mindspore as ms

    flat = [(p if isinstance(p, Tensor) else Tensor(np.asarray(p, np.float32))).reshape(-1).astype(ms.float32)
            for p in pieces]
    return mint.cat(flat)
