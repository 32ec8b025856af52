"""Which parameters a config's `targets` select, and how optimizers keep their Adam moments.

Both are resolved once, when the monitor is attached, never per step.
"""
import re
from typing import Dict, List, Optional, Sequence, Tuple

from mindmon.parallel.chunks import chunk_name, has_chunk, names_match, split_chunk
from mindmon.compat import module_parameters, named_cells
from mindmon.core.names import names_in_model
from mindmon.config import ConfigError

# Attribute pairs (first moment, second moment) of the optimizers that keep Adam state, each a
# ParameterTuple aligned with `optimizer.parameters`:
#   mindspore.nn.Adam                                     moment1 / moment2
#   mindspore.nn.AdamWeightDecay                          moments1 / moments2
#   mindspore.experimental.optim.Adam / AdamW, mint.optim.AdamW, MindFormers' AdamW
#                                                         exp_avg / exp_avg_sq
MOMENT_ATTRIBUTES = (("moment1", "moment2"), ("moments1", "moments2"), ("exp_avg", "exp_avg_sq"))

_SQUASH_PATTERNS = (r"^.*\.(layers?\..*)", r"^.*\.(embeddings?\..*)", r"^.*\.(final.*)", r"^.*\.(output.*)",
                    r"^.*\.(norm.*)")


def squash_name(name: str) -> str:
    """The short name msprobe's `squash_name` gives: from the last `layers.`/`embedding.`/`final`/`output`/
    `norm` component on (`model.decoder.layers.0.mlp.weight` -> `layers.0.mlp.weight`); a model chunk's
    prefix stays (`1:model.layers.0.w` -> `1:layers.0.w`)."""
    if has_chunk(name):
        chunk, bare = split_chunk(name)
        return chunk_name(chunk, squash_name(bare))
    for pattern in _SQUASH_PATTERNS:
        match = re.match(pattern, name)
        if match:
            return match.group(1)
    return name


def optimizer_parameters(optimizer) -> Sequence:
    parameters = getattr(optimizer, "parameters", None)
    if parameters is None or callable(parameters):
        inner = getattr(optimizer, "optimizer", None)
        if inner is not None and inner is not optimizer:
            return optimizer_parameters(inner)
        raise ConfigError(f"optimizer: got {type(optimizer).__name__}, which has no `parameters` tuple; allowed: "
                          f"a MindSpore optimizer (nn.Optimizer, mindspore.experimental.optim.Optimizer) or a "
                          f"wrapper holding one in `.optimizer`")
    return tuple(parameters)


def select_parameters(model, parameters: Sequence, targets: Tuple[str, ...], squash: bool = False
                      ) -> List[Tuple[int, str]]:
    """(index in `parameters`, row name) of every optimizer parameter the targets select: a target is a
    module name from `cells_and_names()` (all its parameters) or a parameter name (or a prefix of one
    ending at a dot), with or without a model chunk's `<c>:` prefix (mindmon.parallel.chunks). No targets = every
    parameter. A target that selects nothing is a ConfigError."""
    chosen = {}
    cell_parameters = _cell_parameters(model, targets)
    names = names_in_model(model, parameters)   # mindnlp's parameters carry random names
    for target in targets:
        found = [i for i, name in enumerate(names)
                 if _matches(name, target) or (squash and _matches(squash_name(name), target))
                 or id(parameters[i]) in cell_parameters.get(target, ())]
        if not found:
            examples = [name for name, _ in list(named_cells(model))[1:4]] + list(names[:3])
            raise ConfigError(f"targets: {target!r} selects no parameter the optimizer trains; allowed: module "
                              f"names from cells_and_names() or parameter names, such as {examples}")
        chosen.update(dict.fromkeys(found))
    indices = sorted(chosen) if targets else range(len(parameters))
    rows: List[Tuple[int, str]] = []
    used = set()
    for i in indices:   # squash_name: the full name where two parameters would share a short one (as msprobe)
        short = squash_name(names[i]) if squash else names[i]
        rows.append((i, names[i] if short in used else short))
        used.add(rows[-1][1])
    return rows


def _matches(name: str, target: str) -> bool:
    return names_match(name, target, prefix_of=True)


def _cell_parameters(model, targets: Tuple[str, ...]) -> Dict[str, set]:
    """{target: ids of the parameters of every cell it names}."""
    found: Dict[str, set] = {}
    for name, cell in named_cells(model):
        for target in targets:
            if names_match(name, target):
                found.setdefault(target, set()).update(id(p) for p in module_parameters(cell))
    return found


def find_moments(optimizer, count: int) -> Optional[Tuple[Sequence, Sequence]]:
    """The optimizer's (first, second) moment tuples aligned with its parameters, looking through one
    `.optimizer` wrapper; None when it keeps no Adam moments."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        for first, second in MOMENT_ATTRIBUTES:
            m, v = getattr(candidate, first, None), getattr(candidate, second, None)
            if m is not None and v is not None and len(m) == count and len(v) == count:
                return tuple(m), tuple(v)
    return None
