"""Heat maps of histogram records (mindmon/formats/histogram.py): per (kind, tensor), one column per
step, one row per entry of the counts (below -1, the 30 bins, above 1, NaN), the count as colour;
drawn again with every new column, as kj600 showed them, into TensorBoard as an image.

Example:
    maps = Heatmaps()
    image = maps.add(record)    # uint8 [height, width, 3], the map up to this record's step
    writer.add_image("adam_update_histogram/fc1.weight", image, record.step, dataformats="HWC")
"""
from typing import Dict, List, Tuple

import numpy as np

from mindmon.formats.histogram import row_labels
from mindmon.core.records import Record


def draw(columns: np.ndarray, steps: List[int], title: str) -> np.ndarray:
    """The image of counts [rows, steps]: rows top-down in the counts' order, steps left to right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.8), dpi=80)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    shown = axes.imshow(columns, cmap="hot", aspect="auto", interpolation="nearest")
    figure.colorbar(shown, ax=axes, label="elements")
    labels = row_labels()
    axes.set_yticks(range(0, len(labels), 2), [labels[i] for i in range(0, len(labels), 2)], fontsize=6)
    ticks = range(0, len(steps), max(1, len(steps) // 10))
    axes.set_xticks(list(ticks), [str(steps[i]) for i in ticks], fontsize=7)
    axes.set_xlabel("step")
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[:, :, :3].copy()


class Heatmaps:
    """The columns seen so far, per (kind, name)."""

    def __init__(self):
        self.columns: Dict[Tuple[str, str], List[List[int]]] = {}
        self.steps: Dict[Tuple[str, str], List[int]] = {}

    def add(self, record: Record, step: int = None) -> np.ndarray:
        key = (record.kind, record.name)
        self.columns.setdefault(key, []).append(list(record.value))
        self.steps.setdefault(key, []).append(record.step if step is None else step)
        matrix = np.array(self.columns[key], dtype=np.float64).T
        return draw(matrix, self.steps[key], f"{record.name}: {record.kind}")
