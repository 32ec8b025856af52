"""Alert rules over records: each rule reads one series of values, (kind, name, statistic) of one
rank, in the order the records are written, and says whether the newest value is an anomaly.

Exact definitions (docs/alerts.md repeats them):

    AnomalyTurbulence(threshold, window=None, direction="both")
        v = |x|; history = |x| of the earlier finite values of the series (all of them, or the
        last `window`); avg = their arithmetic mean. Fires when the history is not empty and
        |v - avg| > threshold * avg (direction "both") or v > (1 + threshold) * avg ("up").
    AnomalyNan(threshold=None)
        fires when x is NaN or +-Inf, or, with a threshold, when |x| > threshold.
    LossSpike(threshold=2.0, window=10, min_history=5)
        history = the last `window` earlier finite values; fires when it holds at least
        `min_history` values, their median m is > 0 and x > threshold * m.
    MoELoadImbalance(threshold)
        fires when x > threshold (x = busiest expert's tokens / mean tokens per expert).
    SkippedSteps(threshold)
        reads `update_skipped` (1: the step's update was skipped, 0: applied); fires at the step
        that makes `threshold` skipped steps in a row, once per such run (the next firing needs an
        applied step first).

Every finite value enters the history of every rule that reads its series, whether it fired or
not; non-finite values enter no history (AnomalyNan reports them).
"""
import math
import statistics as pystats
from collections import deque
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

from mindmon.formats import msprobe_tags
from mindmon.core.records import Record

# The statistic of each mindmon record kind. msprobe-style records say theirs in the name's last
# `/` component (`grad_reduced/fc1.weight/norm`, the TensorBoard tag form).
KIND_STATISTICS = {
    "device_norm": "norm", "micro_norm": "norm", "grad_norm": "norm",
    "local_norm": "norm_increment",     # A_k - A_{k-1}: near zero or negative by nature
    "local_loss": "loss", "device_loss": "loss", "loss": "loss",
    "max_attention_logit": "max",
    "moe_max_over_mean": "max_over_mean", "moe_cv": "cv",
    "moe_min_tokens": "min", "moe_max_tokens": "max", "moe_idle_experts": "count", "moe_dropped_tokens": "count",
    "tokens_per_expert": "tokens", "tokens_per_expert_step": "tokens",
    "learning_rate": "lr", "samples": "count",
    "loss_scale": "scale", "overflow": "flag", "update_skipped": "flag", "skipped_steps": "count",
    "loss_component": "loss", "loss_component_step": "loss",
    "adam_update_histogram": "histogram", "adam_ratio_histogram": "histogram",
}
NOT_JUDGED = ("histogram",)   # counts of a distribution, not a value of the run: no rule reads them
MSPROBE_STATISTICS = ("norm", "min", "max", "mean", "nans", "zeros", "shape", "dtype",
                      "entropy", "softmax_max", "entropy_mean", "softmax_max_mean", "sr",
                      "kernel_norm")   # from entropy on: L2 features

SeriesKey = Tuple[str, str, str]


def tag_and_statistic(record: Record) -> Tuple[str, str]:
    """(tag, statistic) of a record: `kind/name` and the statistic it holds."""
    head, _, last = record.name.rpartition("/")
    if head and last in MSPROBE_STATISTICS:
        return f"{record.kind}/{head}", last
    return f"{record.kind}/{record.name}", KIND_STATISTICS.get(record.kind, record.kind)


def msprobe_tag_and_statistic(record: Record) -> Tuple[str, str]:
    """(tag, statistic) in msprobe's spelling, the msprobe and kj600 front doors' dump
    (`0:fc1.weight/rank0/post_grad`, "norm"); mindmon's for kinds msprobe has no point for."""
    tag, statistic = tag_and_statistic(record)
    head = record.name.rpartition("/")[0]
    name = msprobe_tags.tag_name(record.kind, head, record.micro_step, record.rank) if head else None
    return (name, statistic) if name is not None else (tag, statistic)


def scalar_value(value: Union[float, Sequence[float], None]) -> Optional[float]:
    """The value a rule judges: a float as is; a list (per head, per expert) by its largest
    element, NaN when any element is NaN; None for an empty list or None."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            return None
        floats = [float(v) for v in value]
        return math.nan if any(math.isnan(v) for v in floats) else max(floats)
    return float(value)


@dataclass(frozen=True)
class Verdict:
    rule_name: str
    detail: str   # what the value was compared with, for the message


class Rule:
    """Base: `selects(kind, statistic)` and `judge(series, x) -> Optional[Verdict]`, called with
    every value of every selected series in order."""

    NAME = ""
    DEFAULT_KINDS: Optional[Tuple[str, ...]] = None        # None: every kind
    DEFAULT_STATISTICS: Optional[Tuple[str, ...]] = None   # None: every statistic

    def __init__(self, kinds: Optional[Iterable[str]] = None, statistics: Optional[Iterable[str]] = None):
        self.kinds = tuple(kinds) if kinds is not None else self.DEFAULT_KINDS
        self.statistics = tuple(statistics) if statistics is not None else self.DEFAULT_STATISTICS

    def selects(self, kind: str, statistic: str) -> bool:
        return ((self.kinds is None or kind in self.kinds)
                and (self.statistics is None or statistic in self.statistics))

    def judge(self, series: SeriesKey, x: float) -> Optional[Verdict]:
        raise NotImplementedError


class _History:
    """Earlier finite values per series: all of them (running sum) or the last `window`."""

    def __init__(self, window: Optional[int]):
        self.window = window
        self._values: Dict[SeriesKey, deque] = {}
        self._sums: Dict[SeriesKey, Tuple[float, int]] = {}

    def values(self, series: SeriesKey) -> Sequence[float]:
        return self._values.get(series, ())

    def mean(self, series: SeriesKey) -> Optional[float]:
        if self.window is None:
            total, count = self._sums.get(series, (0.0, 0))
            return total / count if count else None
        values = self._values.get(series)
        return math.fsum(values) / len(values) if values else None

    def add(self, series: SeriesKey, value: float) -> None:
        if not math.isfinite(value):
            return
        if self.window is None:
            total, count = self._sums.get(series, (0.0, 0))
            self._sums[series] = (total + value, count + 1)
        else:
            self._values.setdefault(series, deque(maxlen=self.window)).append(value)


class AnomalyTurbulence(Rule):
    NAME = "AnomalyTurbulence"
    DEFAULT_STATISTICS = ("norm", "mean")

    def __init__(self, threshold: float, window: Optional[int] = None, direction: str = "both", **selection):
        super().__init__(**selection)
        self.threshold, self.direction = threshold, direction
        self.history = _History(window)

    def judge(self, series, x):
        v = abs(x)
        avg = self.history.mean(series)
        self.history.add(series, v)
        if avg is None or not math.isfinite(v):
            return None
        fired = v > (1 + self.threshold) * avg if self.direction == "up" else abs(v - avg) > self.threshold * avg
        return Verdict(self.NAME, f"|value| {v:.6g} vs mean of earlier |values| {avg:.6g}") if fired else None


class AnomalyNan(Rule):
    NAME = "AnomalyNan"

    def __init__(self, threshold: Optional[float] = None, **selection):
        super().__init__(**selection)
        self.threshold = threshold

    def judge(self, series, x):
        if not math.isfinite(x):
            return Verdict(self.NAME, f"value {x}")
        if self.threshold is not None and abs(x) > self.threshold:
            return Verdict(self.NAME, f"|value| {abs(x):.6g} > {self.threshold:g}")
        return None


class LossSpike(Rule):
    """The median of recent losses shrugs off earlier spikes and the slow downward trend, so a
    ratio to it flags a sudden jump without firing on every noisy step."""

    NAME = "LossSpike"
    DEFAULT_KINDS = ("loss", "device_loss")

    def __init__(self, threshold: float = 2.0, window: int = 10, min_history: int = 5, **selection):
        super().__init__(**selection)
        self.threshold, self.min_history = threshold, min_history
        self.history = _History(window)

    def judge(self, series, x):
        earlier = list(self.history.values(series))
        self.history.add(series, x)
        if len(earlier) < self.min_history or not math.isfinite(x):
            return None
        median = pystats.median(earlier)
        if median > 0 and x > self.threshold * median:
            return Verdict(self.NAME, f"value {x:.6g} > {self.threshold:g} x median {median:.6g} of the last "
                                      f"{len(earlier)} values")
        return None


class MoELoadImbalance(Rule):
    """max/mean = 1 is a perfectly balanced router and E means one expert takes every token; above
    a bound some experts starve while the busiest one overflows its capacity."""

    NAME = "MoELoadImbalance"
    DEFAULT_KINDS = ("moe_max_over_mean",)

    def __init__(self, threshold: float, **selection):
        super().__init__(**selection)
        self.threshold = threshold

    def judge(self, series, x):
        if math.isfinite(x) and x > self.threshold:
            return Verdict(self.NAME, f"busiest expert / mean {x:.6g} > {self.threshold:g}")
        return None


class SkippedSteps(Rule):
    """A dynamic loss scale halves at every overflow; a run whose updates are skipped many steps in a
    row is not training (a NaN in the data or the weights, or a scale that cannot go low enough)."""

    NAME = "SkippedSteps"
    DEFAULT_KINDS = ("update_skipped",)

    def __init__(self, threshold: int, **selection):
        super().__init__(**selection)
        self.threshold = int(threshold)
        self._in_a_row: Dict[SeriesKey, int] = {}

    def judge(self, series, x):
        in_a_row = self._in_a_row[series] = self._in_a_row.get(series, 0) + 1 if x >= 0.5 else 0
        if in_a_row == self.threshold:
            return Verdict(self.NAME, f"{in_a_row} skipped steps in a row")
        return None


RULES = {rule.NAME: rule for rule in (AnomalyTurbulence, AnomalyNan, LossSpike, MoELoadImbalance, SkippedSteps)}


def first_verdict(rules: Sequence[Rule], series: SeriesKey, x: float) -> Optional[Verdict]:
    """`rules` are those that read the series. Every one sees the value (so its history stays
    exact); the first that fires wins."""
    winner = None
    for rule in rules:
        verdict = rule.judge(series, x)
        winner = winner or verdict
    return winner
