"""The step's model-parallel sums: one packed SUM all-reduce per group, in the order the data allows.

After the data-parallel reduction (mindmon.parallel.data_parallel) every rank holds the gradients the optimizer
applies, for its shards of its stage's parameters. Then:

    tp (and cp)  [this rank's share of the global squared norm] + the monitors' `shards` parts
                 (mindmon.core.engine.CrossRankPayload: every split parameter's full squared norm) + their
                 `job` parts
    ep           [the share so far] + the `job` parts: experts held by other ranks
    pp           [the share so far, the micro-batch losses, the step's mean loss] + the `job` parts: the
                 other stages' parameters; the losses, which only the last stage computes (the others
                 send zeros)

The `job` parts (one slot per rank, say) come from the data-parallel all-reduce already summed over that
group, and each axis adds its ranks' slots, so after the last axis they hold every rank's values. An axis
whose group lies inside one already summed (Megatron's expert groups lie inside the data-parallel one) is
left out of that sum, which would count its ranks' slots twice.

A rank's share counts a shard on every rank that holds one and a copy only on the first rank of the
axes it is copied over (`ParallelLayout.norm_weight`), so the sum holds every element once: the norm one
device would compute. CPU collectives in a group are SUM all-reduces of float32 (mccl has no float64 and
no all-gather outside the world group), which these sums need and nothing more.
"""
from typing import Dict, List, Sequence

import numpy as np

from .layout import SHARD_AXES
from .norms import PER_PARAMETER_AXES


def packed_sum(group, arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
    """Each array summed over `group` (a DataParallel), in one float32 all-reduce; float64 back."""
    if group is None or group.size == 1 or not arrays:
        return [np.asarray(a, np.float64) for a in arrays]
    from mindspore import Tensor, ops

    flat = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays])
    kwargs = {} if group.group is None else {"group": group.group}
    summed = ops.AllReduce(**kwargs)(Tensor(flat)).asnumpy().astype(np.float64)
    pieces = np.split(summed, np.cumsum([np.size(a) for a in arrays])[:-1])
    return [piece.reshape(np.shape(a)) for piece, a in zip(pieces, arrays)]


def model_parallel_sums(layout, parameters: Sequence) -> "ModelParallelSums":
    """None without a layout or when it has data parallelism only; else the layout checked against the
    optimizer's parameters (before step 1) and the step's sums."""
    if layout is None or not layout.model_parallel:
        return None
    layout = layout.with_parameters(parameters)
    layout.check(parameters)
    return ModelParallelSums(layout, [p.name for p in parameters])


class ModelParallelSums:
    """`finish(squared_norms, losses, mean_loss, group) -> (grad_norm, losses, mean_loss)` for one step.

    `squared_norms`: this rank's squared norm of every gradient, in the order of `names` (the optimizer's
    parameters); `losses`: the micro-batch losses (floats; zeros off the last stage); `exchange`: the
    monitors' cross-rank payloads of the step (mindmon.core.cross_rank.CrossRankExchange), or None.
    """

    def __init__(self, layout, names: Sequence[str]):
        self.layout = layout
        self.weights = layout.norm_weights(SHARD_AXES, names)
        # A pipeline's micro-batch losses are known once the last stage has sent them.
        self.deferred_losses = layout.size("pp") > 1
        self._job_axes = None

    def finish(self, squared_norms: np.ndarray, losses: Sequence[float], mean_loss: float, exchange):
        layout = self.layout
        share = np.array([float(np.dot(self.weights, squared_norms))])
        for axis in PER_PARAMETER_AXES:
            if layout.size(axis) > 1:
                share, = self._with_payloads(axis, [share], exchange, shards=True)
        if layout.size("ep") > 1:
            share, = self._with_payloads("ep", [share], exchange)
        if layout.size("pp") > 1:
            last = 1.0 if layout.last_stage else 0.0
            share, summed_losses, summed_mean = self._with_payloads(
                "pp", [share, np.asarray(losses, np.float64) * last, np.array([mean_loss * last])], exchange)
            losses, mean_loss = list(summed_losses), float(summed_mean[0])
        return float(np.sqrt(share[0])), list(losses), mean_loss

    @property
    def job_axes(self) -> tuple:
        """Read when a monitor first sends a `job` part (it asks the groups for their members)."""
        if self._job_axes is None:
            self._job_axes = job_axes(self.layout)
        return self._job_axes

    def _with_payloads(self, axis: str, arrays: list, exchange, shards: bool = False) -> list:
        """`arrays` summed over the axis' group in one all-reduce, with the exchange's `shards` part (tp, cp)
        and its `job` part (every axis of `job_axes`) riding along; those sums go back to the exchange."""
        riding = []
        if exchange is not None and shards:
            riding.append(("shards", exchange.shards()))
        if exchange is not None and exchange.size("job") and axis in self.job_axes:
            riding.append(("job", exchange.job()))
        summed = packed_sum(self.layout.groups[axis], list(arrays) + [values for _, values in riding])
        for (part, _), values in zip(riding, summed[len(arrays):]):
            (exchange.set_shards if part == "shards" else exchange.set_job)(values)
        return summed[:len(arrays)]


def job_axes(layout) -> tuple:
    """The model-parallel axes a sum over every rank of the job goes through after the data-parallel
    all-reduce: each axis of more than one rank whose group does not lie inside the data-parallel group or
    an axis' group already taken."""
    taken = [set(layout.data_parallel.world_ranks())] if layout.data_parallel.active else []
    axes = []
    for axis in ("tp", "cp", "ep", "pp"):
        if layout.size(axis) > 1:
            members = set(layout.groups[axis].world_ranks())
            if not any(members <= group for group in taken):
                axes.append(axis)
                taken.append(members)
    return tuple(axes)


def summed_over(layout, axes: Sequence[str], arrays: Sequence[np.ndarray]) -> list:
    """Each array summed over the groups of `axes` that have more than one rank: one packed all-reduce
    per axis (`packed_sum`)."""
    arrays = [np.asarray(a, np.float64) for a in arrays]
    for axis in axes:
        if layout.size(axis) > 1:
            arrays = packed_sum(layout.groups[axis], arrays)
    return arrays


class FullParameterNorms:
    """Squared norms of parameters (or of their optimizer state, placed as the parameter) made full-parameter
    ones at step end, for the monitors that read state after the update (monitor_config's weight and Adam
    norms): each rank's squared norms weighted by `ParallelLayout.norm_weight`, then summed over the groups.

    Example:
        full = FullParameterNorms(layout, [p.name for p in parameters])
        per_parameter = full.per_parameter([squared_m, squared_v])   # over tp and cp: each full parameter
        total = full.total(squared)                                  # every shard of every stage once
    """

    def __init__(self, layout, names: Sequence[str]):
        self.layout, self.names = layout, list(names)
        self._weights: Dict[tuple, np.ndarray] = {}

    def weights(self, axes: Sequence[str]) -> np.ndarray:
        """Read at the first use, once the train step has added the parameters' own placements."""
        key = tuple(axes)
        if key not in self._weights:
            self._weights[key] = np.array([self.layout.norm_weight(name, axes) for name in self.names], np.float64)
        return self._weights[key]

    def per_parameter(self, squared: Sequence[np.ndarray]) -> list:
        """Each array's full-parameter squared norms (summed over tp and cp), in one all-reduce per axis."""
        weights = self.weights(PER_PARAMETER_AXES)
        return summed_over(self.layout, PER_PARAMETER_AXES, [np.asarray(s) * weights for s in squared])

    def total(self, squared: np.ndarray) -> float:
        """The squared norm of the whole model: every shard of every stage and expert once."""
        share = np.array([float(np.dot(self.weights(SHARD_AXES), squared))])
        return float(summed_over(self.layout, SHARD_AXES + ("pp",), [share])[0][0])
