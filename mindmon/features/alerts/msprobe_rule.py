"""msprobe's AnomalyTurbulence: |x| against an exponential moving average of the earlier |x|.

    avg_1 = |x_1|;  x_n fires when |x_n| > (1 + threshold) * avg_n;  then avg_{n+1} = 0.99 avg_n + 0.01 |x_n|

per series (kind, name, statistic of one rank), compared before the update, upward only, on `norm`
and `mean` by default: msprobe 26.2's rule (its writer keeps the average per tag), which the msprobe
and kj600 front doors apply. The first value of a series never fires (it is its own average).
One difference, deliberate: a NaN or an infinity enters no average here (AnomalyNan reports it);
in msprobe it makes the tag's average NaN, and that tag never fires again.

Example:
    rule = EmaTurbulence(threshold=0.5)
    [rule.judge(("grad_reduced", "fc1.weight/norm", "norm"), x) is not None for x in (2, 2.5, 3.5)]
    # [False, False, True]: 3.5 > 1.5 * (0.99 * 2 + 0.01 * 2.5)
"""
import math
from typing import Dict, Optional

from mindmon.features.alerts.rules import Rule, SeriesKey, Verdict

BETA = 0.99   # msprobe's weight of the earlier average


class EmaTurbulence(Rule):
    NAME = "AnomalyTurbulence"
    DEFAULT_STATISTICS = ("norm", "mean")

    def __init__(self, threshold: float, direction: str = "up", **selection):
        super().__init__(**selection)
        self.threshold, self.direction = threshold, direction
        self.averages: Dict[SeriesKey, float] = {}

    def judge(self, series: SeriesKey, x: float) -> Optional[Verdict]:
        v = abs(x)
        if not math.isfinite(v):
            return None
        avg = self.averages.get(series, v)
        # msprobe's arithmetic, to the last bit: beta * avg + (1 - beta) * |x|.
        self.averages[series] = BETA * avg + (1 - BETA) * v
        fired = v > (1 + self.threshold) * avg if self.direction == "up" else abs(v - avg) > self.threshold * avg
        if not fired:
            return None
        return Verdict(self.NAME, f"|value| {v:.6g} vs exponential average of earlier |values| {avg:.6g}")
