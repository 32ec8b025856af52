"""Finding the cells a probe attaches to, by a regular expression on their names."""
import re
from typing import List, Tuple

from mindmon.compat import named_cells as all_cells


def named_cells(model, pattern: str, what: str) -> List[Tuple[str, object]]:
    """(name, cell) for every cell (or mindnlp module) whose full name matches `pattern` (re.search), in model order."""
    regex = re.compile(pattern)
    cells = [(name, cell) for name, cell in all_cells(model) if name and regex.search(name)]
    if not cells:
        examples = [name for name, _ in all_cells(model) if name][:6]
        raise ValueError(f"{what}: the pattern {pattern!r} matches no cell of {type(model).__name__}; "
                         f"allowed: a regular expression over cell names such as {examples}")
    return cells
