"""The value of a histogram record (kinds `adam_update_histogram`, `adam_ratio_histogram`): counts of a
vector's elements over [-1, 1] in 30 equal bins, with what falls outside counted too, never dropped:

    value[0]        elements < -1 (-inf included)
    value[1..30]    bin i covers [-1 + 2(i-1)/30, -1 + 2i/30); the last one includes 1
    value[31]       elements > 1 (+inf included)
    value[32]       NaN elements

so the counts add up to the vector's size. msprobe's heat maps (torch.histc) count only the 30 bins.

Example:
    counts = histogram(np.array([-2.0, -1.0, 0.0, 1.0, 1.5, np.nan]))
    counts[BELOW], counts[1], counts[16], counts[HISTOGRAM_BINS], counts[ABOVE], counts[NANS]   # 1 1 1 1 1 1
"""
from typing import List

import numpy as np

ADAM_UPDATE_HISTOGRAM, ADAM_RATIO_HISTOGRAM = "adam_update_histogram", "adam_ratio_histogram"
HISTOGRAM_KINDS = (ADAM_UPDATE_HISTOGRAM, ADAM_RATIO_HISTOGRAM)
HISTOGRAM_BINS, HISTOGRAM_RANGE = 30, (-1.0, 1.0)
BELOW, ABOVE, NANS = 0, HISTOGRAM_BINS + 1, HISTOGRAM_BINS + 2


def histogram(values) -> List[int]:
    """Counts in the layout above."""
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    inside, _ = np.histogram(flat[np.isfinite(flat)], bins=HISTOGRAM_BINS, range=HISTOGRAM_RANGE)
    low, high = HISTOGRAM_RANGE
    return ([int(np.count_nonzero(flat < low))] + inside.tolist() +
            [int(np.count_nonzero(flat > high)), int(np.count_nonzero(np.isnan(flat)))])


def histogram_edges() -> np.ndarray:
    return np.linspace(*HISTOGRAM_RANGE, HISTOGRAM_BINS + 1)


def row_labels() -> List[str]:
    """A label per entry of the value, in its order."""
    edges = histogram_edges()
    return ([f"< {edges[0]:g}"] + [f"{edges[i]:.2f}..{edges[i + 1]:.2f}" for i in range(HISTOGRAM_BINS)] +
            [f"> {edges[-1]:g}", "nan"])
