"""Per-parameter squared norms of full parameters under tensor / context parallelism (of state read after
the update instead, such as the weights: mindmon.parallel.reduce.FullParameterNorms).

A monitor's squared norms for one step (K accumulated, K micro-batch, and the data-parallel reduced
gradient's) form a (2K + 1, n) matrix; each column is weighted by `ParallelLayout.norm_weight` over
tp and cp (a shard counts on every rank, a copy only on the first rank), so the sum over those groups,
which `ModelParallelSums` takes inside the step's collectives, is each full parameter's squared norm.
"""
from typing import Dict, Hashable, Optional, Sequence

import numpy as np

PER_PARAMETER_AXES = ("tp", "cp")   # the per-parameter norms; an expert is a parameter of its own


class ShardedNorms:
    """Example:
        shards = ShardedNorms(layout, names)
        payload = shards.current(K, squared_norms.results(), micro_steps=[0, 1], with_micro=True)
        shards.receive(summed_payload)            # after the tp (and cp) all-reduce
        shards.results([0, 1])                    # {("accumulated", 0): full squared norms, ...}
    """

    def __init__(self, layout, names: Sequence[str], indices: Sequence[int], all_names: Sequence[str]):
        """`names`: the monitor's parameters, at `indices` of the optimizer's (`all_names`, the model's names)."""
        self.layout, self.names = layout, list(names)
        self.indices, self.all_names = np.asarray(indices, np.int64), list(all_names)
        self._weights: Optional[np.ndarray] = None
        self.clear()

    @property
    def weights(self) -> np.ndarray:
        """Read at the first step, once the train step has added the parameters' own placements."""
        if self._weights is None:
            self._weights = self.layout.norm_weights(PER_PARAMETER_AXES, self.all_names)[self.indices]
        return self._weights

    @staticmethod
    def needed(layout) -> bool:
        return layout is not None and any(layout.size(axis) > 1 for axis in PER_PARAMETER_AXES)

    def clear(self) -> None:
        self._summed: Optional[np.ndarray] = None
        self._has_reduced = False

    def size(self, num_micro_steps: int) -> int:
        return len(self.names) * (2 * num_micro_steps + 1)

    def current(self, num_micro_steps: int, squared: Dict[Hashable, np.ndarray], micro_steps: Sequence[int],
                with_micro: bool) -> np.ndarray:
        """The payload to sum over tp and cp: this rank's weighted squared norms."""
        matrix = np.zeros((2 * num_micro_steps + 1, self.weights.size))
        for k in micro_steps:
            if 0 <= k < num_micro_steps:
                matrix[k] = squared[("accumulated", k)]
                if with_micro and ("micro", k) in squared:
                    matrix[num_micro_steps + k] = squared[("micro", k)]
        self._has_reduced = "reduced" in squared
        if self._has_reduced:
            matrix[-1] = squared["reduced"]
        return (matrix * self.weights).reshape(-1)

    def receive(self, sums: np.ndarray) -> None:
        self._summed = np.asarray(sums, np.float64).reshape(-1, self.weights.size)

    def results(self, micro_steps: Sequence[int], local: Dict[Hashable, np.ndarray]) -> Dict[Hashable, np.ndarray]:
        """The full parameters' squared norms under the keys `SquaredNorms.results` uses; `local` (this
        rank's own) when no sums were received (a loop that does not run the model-parallel step)."""
        if self._summed is None:
            return local
        num_micro_steps = (self._summed.shape[0] - 1) // 2
        out = {}
        for k in micro_steps:
            out[("accumulated", k)] = self._summed[k]
            out[("micro", k)] = self._summed[num_micro_steps + k]
        if self._has_reduced:
            out["reduced"] = self._summed[-1]
        return out

