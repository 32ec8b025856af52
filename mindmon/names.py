"""Parameter names for a plain loop: the model's own names, in the order the optimizer holds them.

mindmon records one value per gradient, and the gradients come in `optimizer.parameters` order, so
the names must come in that order too. `Parameter.name` is the name in a MindSpore Cell built the
usual way, but not in every model: mindnlp's HuggingFace-style modules give their parameters unique
ids as `name`, and only the model's traversal knows `model.layers.0.self_attn.q_proj.weight`.

Example:
    group = build_group(config, model=net, parameter_names=parameter_names(net, optimizer))
"""
from typing import List, Sequence


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
