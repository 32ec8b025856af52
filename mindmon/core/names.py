"""Names in a model: its parameters' names in the order the optimizer holds them, and its cells by a pattern.

mindmon records one value per gradient, and the gradients come in `optimizer.parameters` order, so
the names must come in that order too. `Parameter.name` is the name in a MindSpore Cell built the
usual way, but not in every model: mindnlp's HuggingFace-style modules give their parameters unique
ids as `name`, and only the model's traversal knows `model.layers.0.self_attn.q_proj.weight`.

Example:
    group = build_group(config, model=net, parameter_names=parameter_names(net, optimizer))
"""
import re
from typing import List, Sequence, Tuple

from mindmon.compat import named_cells


def _named_parameters(model):
    """(name, parameter) pairs: MindSpore's `parameters_and_names()`, or the `named_parameters()` of
    a torch-style module (mindnlp)."""
    if hasattr(model, "parameters_and_names"):
        return model.parameters_and_names()
    return model.named_parameters()


def parameter_names(model, optimizer) -> List[str]:
    """The name the model gives each of `optimizer.parameters`, in that order. A parameter the model
    does not hold (an optimizer built over more than the model) keeps its `Parameter.name`."""
    return names_in_model(model, optimizer.parameters)


def names_in_model(model, parameters: Sequence) -> List[str]:
    """The name the model gives each of `parameters`, in their order (see `parameter_names`)."""
    by_identity = {}
    for name, parameter in _named_parameters(model):
        by_identity.setdefault(id(parameter), name)   # a shared (tied) parameter keeps its first name
    return [by_identity.get(id(parameter), parameter.name) for parameter in parameters]


def cells_matching(model, pattern: str, what: str) -> List[Tuple[str, object]]:
    """(name, cell) for every cell (or mindnlp module) whose full name matches `pattern` (re.search), in model
    order; none matching raises ValueError naming `what` and a few of the model's cell names."""
    regex = re.compile(pattern)
    cells = [(name, cell) for name, cell in named_cells(model) if name and regex.search(name)]
    if not cells:
        examples = [name for name, _ in named_cells(model) if name][:6]
        raise ValueError(f"{what}: the pattern {pattern!r} matches no cell of {type(model).__name__}; "
                         f"allowed: a regular expression over cell names such as {examples}")
    return cells
