"""Adam's bias-corrected update and ratio (`ur_distribution`) and the gradient/momentum direction
(`mg_direction`), per monitored parameter and collected step, from the optimizer's own state before
its update (definitions in docs/msprobe.md, "Optimizer diagnostics"):

    t         the optimizer's count of updates made so far (its `global_step` or `state_step`)
    m_hat     exp_avg / (1 - beta1^t),   v_hat = exp_avg_sq / (1 - beta2^t)   (its own betas and eps)
    update    m_hat / (sqrt(v_hat) + eps)                      -> kind adam_update (the configured ops)
    ratio     m_hat / sqrt(v_hat)                              -> kind adam_ratio
    histogram of each over [-1, 1], 30 equal bins, the values outside counted too (mindmon/formats/histogram.py)
                                                               -> kinds adam_update_histogram, adam_ratio_histogram
    mg_direction  ((sign(g) * sign(exp_avg)).sum() / numel + 1) / 2, 1.0 at step 0 (g: the gradient the
                  optimizer gets)                                -> kind mg_direction (the configured ops)

With t = 0 (no update made yet: the moments are zeros and 1 - beta^0 = 0) there is no update or ratio:
the step has no column. Everything is computed in float64 from the float32 state.

Example:
    adam = AdamState.of(optimizer, parameters, moments, "ur_distribution")   # ConfigError when it cannot be read
    adam.record(group, step=3, named=[(0, "fc1.weight", grad), ...], ur=True, mg=True)
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from mindmon.config import ConfigError
from mindmon.formats.histogram import ADAM_RATIO_HISTOGRAM, ADAM_UPDATE_HISTOGRAM, HISTOGRAM_KINDS, histogram
from mindmon.features.tensor_stats.monitor import TensorStatsMonitor
from mindmon.core.records import Record

MG_DIRECTION = "mg_direction"
ADAM_UPDATE, ADAM_RATIO = "adam_update", "adam_ratio"
ADAM_OPTIMIZERS = "nn.Adam, nn.AdamWeightDecay, mindspore.experimental.optim.Adam/AdamW, MindFormers AdamW"


def same_direction_share(grad: np.ndarray, exp_avg: np.ndarray) -> float:
    signs = np.sign(np.asarray(grad, np.float64).reshape(-1)) * np.sign(np.asarray(exp_avg, np.float64).reshape(-1))
    return float((signs.sum() / exp_avg.size + 1) / 2) if exp_avg.size else 1.0


@dataclass(frozen=True)
class AdamHyper:
    beta1: float
    beta2: float
    eps: float


def _scalar(value) -> float:
    return float(np.asarray(value.asnumpy() if hasattr(value, "asnumpy") else value, np.float64).reshape(-1)[0])


def _hyperparameters(optimizer, count: int) -> Optional[List[AdamHyper]]:
    """Per parameter: MindSpore's nn optimizers keep beta1/beta2/eps tensors; the experimental ones
    (PyTorch-style) keep them per parameter group."""
    if all(hasattr(optimizer, key) for key in ("beta1", "beta2", "eps")):
        hyper = AdamHyper(_scalar(optimizer.beta1), _scalar(optimizer.beta2), _scalar(optimizer.eps))
        return [hyper] * count
    groups, starts = getattr(optimizer, "param_groups", None), getattr(optimizer, "group_start_id", None)
    if not groups or starts is None or "betas" not in groups[0]:
        return None
    out = []
    for index, group in enumerate(groups):
        beta1, beta2 = group["betas"]
        out += [AdamHyper(float(np.float32(beta1)), float(np.float32(beta2)), float(group["eps"]))] * \
            (starts[index + 1] - starts[index])
    return out if len(out) == count else None


def _step_counter(optimizer):
    """The Parameter counting the updates made: `state_step` (experimental optimizers), `global_step`."""
    for name in ("state_step", "global_step"):
        counter = getattr(optimizer, name, None)
        if counter is not None and hasattr(counter, "asnumpy"):
            return counter
    return None


def _host(tensor) -> np.ndarray:
    return tensor if isinstance(tensor, np.ndarray) else tensor.asnumpy()


class AdamState:
    """What ur_distribution and mg_direction read from one optimizer, resolved once at set_monitor."""

    def __init__(self, moments: Tuple[Sequence, Sequence], hyper: List[AdamHyper], counter):
        self.first, self.second = moments
        self.hyper, self.counter = hyper, counter

    @classmethod
    def of(cls, optimizer, parameters: Sequence, moments, key: str) -> "AdamState":
        name = type(optimizer).__name__
        inner = getattr(optimizer, "optimizer", None)
        source = optimizer if _step_counter(optimizer) is not None or inner is None else inner
        hyper = _hyperparameters(source, len(parameters))
        counter = _step_counter(source)
        if moments is None or hyper is None or counter is None:
            missing = "Adam moments" if moments is None else "its betas, eps and step count"
            raise ConfigError(f"{key}: got True, but the optimizer {name} keeps no {missing} mindmon can read; "
                              f"allowed: an Adam-type optimizer ({ADAM_OPTIMIZERS}) or {key}: false")
        return cls(moments, hyper, counter)

    def updates(self) -> int:
        return int(np.asarray(self.counter.asnumpy()).reshape(-1)[0])

    def record(self, group, step: int, named: Sequence[tuple], ur: bool, mg: bool) -> None:
        """named: (parameter index, row name, the gradient the optimizer gets or None)."""
        if mg:
            group.record(MG_DIRECTION, [(name, np.array(1.0 if step == 0 else
                                                         same_direction_share(_host(g), _host(self.first[i]))))
                                        for i, name, g in named if g is not None])
        t = self.updates() if ur else 0
        if t < 1:
            return
        vectors = [(name,) + self._update_and_ratio(i, t) for i, name, _ in named]
        for column, kind, histogram_kind in ((1, ADAM_UPDATE, ADAM_UPDATE_HISTOGRAM),
                                             (2, ADAM_RATIO, ADAM_RATIO_HISTOGRAM)):
            group.record(kind, [(row[0], row[column]) for row in vectors])
            group.record(histogram_kind, [(row[0], histogram(row[column])) for row in vectors])

    def _update_and_ratio(self, index: int, t: int) -> Tuple[np.ndarray, np.ndarray]:
        hyper = self.hyper[index]
        m_hat = _host(self.first[index]).astype(np.float64) / (1 - hyper.beta1 ** t)
        root = np.sqrt(_host(self.second[index]).astype(np.float64) / (1 - hyper.beta2 ** t))
        with np.errstate(divide="ignore", invalid="ignore"):   # v = 0: a ratio of 0/0 is NaN, counted as such
            return m_hat / (root + hyper.eps), m_hat / root


class OptimizerStateMonitor(TensorStatsMonitor):
    """The statistics (`ops`) of mg_direction and of the update and ratio vectors, and the histograms as
    plain records (value: the counts, in mindmon/formats/histogram.py's layout)."""

    KEYS = (MG_DIRECTION, ADAM_UPDATE, ADAM_RATIO) + HISTOGRAM_KINDS

    def __init__(self, ops: Sequence[str], eps: float = 1e-8, on_host: Optional[bool] = None, rank: int = 0):
        super().__init__(ops, eps, True, rank)   # numpy arrays by now, wherever the state lives
        self._histograms: List[tuple] = []

    def record(self, key: str, value=None, context: Optional[dict] = None) -> None:
        if key in HISTOGRAM_KINDS:
            self._histograms += [(key, name, counts) for name, counts in value]
        else:
            super().record(key, value, context)

    def collect(self, step: int) -> List[Record]:
        histograms = [Record(step, None, self.rank, kind, name, list(counts)) for kind, name, counts in self._histograms]
        return super().collect(step) + histograms   # which resets, histograms included

    def reset(self) -> None:
        super().reset()
        self._histograms = []


def adam_state_for(config, optimizer, parameters: Sequence) -> Optional[AdamState]:
    """The AdamState a TensorStatsConfig needs (None without ur_distribution and mg_direction); a
    ConfigError naming the key when the optimizer keeps nothing to read."""
    if not config.reads_adam_state:
        return None
    from mindmon.features.tensor_stats.targets import find_moments

    key = "ur_distribution" if config.ur_distribution else "mg_direction"
    return AdamState.of(optimizer, parameters, find_moments(optimizer, len(parameters)), key)
