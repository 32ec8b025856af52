"""The monitor_config quantities no other mindmon monitor computes: stable rank and largest eigenvalue
of WᵀW, the L2 norm of all weights, the norms of the Adam moments, throughput linearity.

Definitions (docs/monitor-config.md):
    weight_eigenvalue/<p>   λ_max(WᵀW) = σ_max(W)², by power iteration on WᵀW
    weight_stable_rank/<p>  ‖W‖_F² / λ_max(WᵀW)   (a 3-D weight: one value per expert, W[e])
    weight_norm             sqrt(Σ_p ‖p‖²) over every trainable parameter
    adam_m_norm/<p>, adam_v_norm/<p>   ‖first moment‖, ‖second moment‖ of each selected parameter
    throughput_linearity    (global_batch_size / data-parallel size / step seconds) / throughput_baseline
All are read at step end, after the update, every `step_interval` steps (the stable rank every
`stable_rank_config.step_interval` steps).
"""
import logging
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from mindmon.core.engine import Monitor
from mindmon.features.l2.monitor import power_iteration
from mindmon.core.records import Record
from mindmon.kernels.stats import SquaredNorms
from mindmon.parallel.norms import ShardedNorms
from mindmon.parallel.reduce import FullParameterNorms

WEIGHT_STABLE_RANK = "weight_stable_rank"
WEIGHT_EIGENVALUE = "weight_eigenvalue"
WEIGHT_NORM = "weight_norm"
ADAM_M_NORM = "adam_m_norm"
ADAM_V_NORM = "adam_v_norm"
THROUGHPUT_LINEARITY = "throughput_linearity"
GLOBAL_NORM_SPIKES = "global_norm_spike_count"   # consecutive steps at or above the spike threshold
STEP_LEVEL_NAME = "global"                        # the record name of one-number-per-step kinds


class StableRankMonitor(Monitor):
    """Stable rank and largest eigenvalue of WᵀW for the 2-D and 3-D (one matrix per expert) weights
    `target` selects. Each weight's power iteration starts from the vector the previous collection
    ended with (the weights move little between steps, so a few iterations stay converged); the
    first collection starts from a fixed random vector."""

    def __init__(self, model, section, rank: int = 0, logger: Optional[logging.Logger] = None):
        self.section = section
        self.rank = rank
        self.parameters = []
        skipped = []
        for parameter in model.trainable_params():
            if not section.selects(parameter.name):
                continue
            (self.parameters if len(parameter.shape) in (2, 3) else skipped).append(parameter)
        if skipped:
            (logger or logging.getLogger("mindmon")).warning(
                "mindmon: monitor_config.stable_rank_config: %d selected parameter(s) are not 2-D or 3-D and get no "
                "stable rank (e.g. %s)", len(skipped), skipped[0].name)
        self._vectors: Dict[str, list] = {}

    def collect(self, step: int) -> List[Record]:
        if step % self.section.step_interval:
            return []
        records = []
        for parameter in self.parameters:
            stable, eigen = self._of(parameter.name, parameter.asnumpy())
            records += self._records(step, parameter.name, stable, eigen)
        return records

    def _of(self, name: str, weight: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(stable rank, largest eigenvalue of WᵀW) per matrix: `power_iteration_num` rounds of the
        L2 features' power iteration (mindmon/features/l2/monitor.py), warm-started per matrix."""
        matrices = weight.astype(np.float32).reshape((-1,) + weight.shape[-2:])
        starts = self._vectors.get(name) or [None] * len(matrices)
        eigen, vectors = [], []
        for matrix, start in zip(matrices, starts):
            sigma, vector, _ = power_iteration(matrix, start, tolerance=0.0,
                                             max_iterations=self.section.power_iteration_num)
            eigen.append(sigma * sigma)
            vectors.append(vector)
        self._vectors[name] = vectors
        eigen = np.array(eigen, dtype=np.float64)
        frobenius = np.einsum("bij,bij->b", matrices.astype(np.float64), matrices.astype(np.float64))
        stable = np.where(eigen > 0, frobenius / np.where(eigen > 0, eigen, 1.0), 0.0)
        return stable, eigen

    def _records(self, step: int, name: str, stable: np.ndarray, eigen: np.ndarray) -> List[Record]:
        if stable.size == 1:
            return [self._record(step, WEIGHT_STABLE_RANK, name, stable[0]),
                    self._record(step, WEIGHT_EIGENVALUE, name, eigen[0])]
        records, mode = [], self.section.moe_show_mode
        for kind, values in ((WEIGHT_STABLE_RANK, stable), (WEIGHT_EIGENVALUE, eigen)):
            if mode in ("all", "full"):
                records += [self._record(step, kind, f"{name}/expert_{e}", v) for e, v in enumerate(values)]
            if mode in ("all", "statistics"):
                records += [self._record(step, kind, f"{name}/expert_{label}", reduce(values))
                            for label, reduce in (("max", np.max), ("min", np.min), ("mean", np.mean))]
        return records

    def _record(self, step, kind, name, value) -> Record:
        return Record(step, None, self.rank, kind, name, float(value))


class WeightStateMonitor(Monitor):
    """weight_norm: the L2 norm of every trainable parameter together, every `step_interval` steps."""

    def __init__(self, model, step_interval: int, rank: int = 0, on_host: bool = True, layout=None):
        self.parameters = list(model.trainable_params())
        self.step_interval = step_interval
        self.rank = rank
        self.on_host = on_host
        # Under model parallelism: the whole model's norm (every shard of every stage once), on every rank.
        self.full = _full_norms(layout, [p.name for p in self.parameters])

    def collect(self, step: int) -> List[Record]:
        if step % self.step_interval or not self.parameters:
            return []
        norms = SquaredNorms(self.on_host)
        norms.add("weights", self.parameters)
        squared = norms.results()["weights"]
        total = float(np.sqrt(self.full.total(squared) if self.full is not None else squared.sum()))
        return [Record(step, None, self.rank, WEIGHT_NORM, STEP_LEVEL_NAME, total)]


class OptimizerStateMonitor(Monitor):
    """adam_m_norm / adam_v_norm of the parameters `selects(name)` keeps, every `step_interval` steps,
    one host transfer per moment. An optimizer without Adam moments: a warning, no records."""

    def __init__(self, optimizer, selects, step_interval: int, rank: int = 0, on_host: bool = True,
                 logger: Optional[logging.Logger] = None, layout=None):
        from mindmon.features.tensor_stats.targets import find_moments, optimizer_parameters

        parameters = optimizer_parameters(optimizer)
        moments = find_moments(optimizer, len(parameters))
        if moments is None:
            (logger or logging.getLogger("mindmon")).warning(
                "mindmon: monitor_config.optimizer_state_format: %s keeps no Adam moments; nothing is recorded",
                type(optimizer).__name__)
            moments = ((), ())
        keep = [i for i, p in enumerate(parameters) if selects(p.name)] if moments[0] else []
        self.names = [parameters[i].name for i in keep]
        self.first = [moments[0][i] for i in keep]
        self.second = [moments[1][i] for i in keep]
        self.step_interval = step_interval
        self.rank = rank
        self.on_host = on_host
        # Under tensor / context parallelism: each full parameter's moments, written by the first rank of
        # its tp and cp groups (the moments are placed as their parameter).
        self.full = _full_norms(layout, self.names) if ShardedNorms.needed(layout) else None
        self.writes = layout is None or layout.writes_full_parameters

    def collect(self, step: int) -> List[Record]:
        if step % self.step_interval or not self.names:
            return []
        norms = SquaredNorms(self.on_host)
        norms.add(ADAM_M_NORM, self.first)
        norms.add(ADAM_V_NORM, self.second)
        squared = norms.results()
        if self.full is not None:
            squared = dict(zip((ADAM_M_NORM, ADAM_V_NORM),
                               self.full.per_parameter([squared[ADAM_M_NORM], squared[ADAM_V_NORM]])))
        if not self.writes:
            return []
        return [Record(step, None, self.rank, kind, name, float(np.sqrt(value)))
                for kind in (ADAM_M_NORM, ADAM_V_NORM) for name, value in zip(self.names, squared[kind])]


def _full_norms(layout, names):
    """The full-parameter sums of a model-parallel layout; None without one (or with data parallelism only)."""
    if layout is None or not layout.model_parallel:
        return None
    return FullParameterNorms(layout, names)


class ThroughputMonitor(Monitor):
    """throughput_linearity: samples per second per data-parallel rank over the step (from the step's
    begin, `reset`, to its end, `collect`), divided by the baseline."""

    def __init__(self, baseline: float, global_batch_size: Optional[int], ranks: int, step_interval: int,
                 rank: int = 0, clock=time.perf_counter):
        self.baseline = baseline
        self.global_batch_size = global_batch_size
        self.ranks = max(ranks, 1)
        self.step_interval = step_interval
        self.rank = rank
        self.clock = clock
        self._began: Optional[float] = None

    def reset(self) -> None:
        self._began = self.clock()

    def collect(self, step: int) -> List[Record]:
        began, self._began = self._began, None
        if began is None or not self.global_batch_size or step % self.step_interval:
            return []
        seconds = self.clock() - began
        if seconds <= 0:
            return []
        linearity = self.global_batch_size / self.ranks / seconds / self.baseline
        return [Record(step, None, self.rank, THROUGHPUT_LINEARITY, STEP_LEVEL_NAME, linearity)]
