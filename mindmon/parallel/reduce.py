"""The step's model-parallel sums: one packed SUM all-reduce per group, in the order the data allows.

After the data-parallel reduction (mindmon.distributed) every rank holds the gradients the optimizer
applies, for its shards of its stage's parameters. Then:

    tp (and cp)  [this rank's share of the global squared norm] + the monitors' per-parameter squared
                 norms (`MonitorGroup.shard_sums`): every split parameter's full squared norm
    ep           [the share so far]: experts held by other ranks
    pp           [the share so far, the micro-batch losses, the step's mean loss]: the other stages'
                 parameters; the losses, which only the last stage computes (the others send zeros)

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
    parameters); `losses`: the micro-batch losses (floats; zeros off the last stage); `group`: the
    MonitorGroup whose monitors add their per-parameter sums to the tp/cp collectives, or None.
    """

    def __init__(self, layout, names: Sequence[str]):
        self.layout = layout
        self.weights = layout.norm_weights(SHARD_AXES, names)
        # A pipeline's micro-batch losses are known once the last stage has sent them.
        self.deferred_losses = layout.size("pp") > 1

    def finish(self, squared_norms: np.ndarray, losses: Sequence[float], mean_loss: float, group):
        layout, num_micro_steps = self.layout, len(losses)
        share = np.array([float(np.dot(self.weights, squared_norms))])
        for axis in PER_PARAMETER_AXES:
            if layout.size(axis) > 1:
                payload = group.shard_sums(num_micro_steps) if group is not None else []
                share, *sums = packed_sum(layout.groups[axis], [share] + payload)
                if group is not None:
                    group.receive_shard_sums(sums, num_micro_steps)
        if layout.size("ep") > 1:
            share, = packed_sum(layout.groups["ep"], [share])
        if layout.size("pp") > 1:
            last = 1.0 if layout.last_stage else 0.0
            share, summed_losses, summed_mean = packed_sum(
                layout.groups["pp"], [share, np.asarray(losses, np.float64) * last, np.array([mean_loss * last])])
            losses, mean_loss = list(summed_losses), float(summed_mean[0])
        return float(np.sqrt(share[0])), list(losses), mean_loss


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
