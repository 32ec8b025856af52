"""The model chunks of a virtual pipeline (VPP) as one name space, in msprobe's convention.

Under a virtual pipeline a rank holds several model chunks (Megatron's `model` list). msprobe's
`set_monitor` takes that list and names every cell and parameter of chunk c `"<c>:<name>"`
(`"1:layers.0.mlp.weight"`); its CSV splits the prefix off into the `vpp_stage` column and its anomaly
dump reads `vpp_stage` from it. A single model keeps its plain names (chunk 0), as msprobe's CSV shows
them. A target matches with or without the prefix: `"1:layers.0"` the cell of chunk 1 only,
`"layers.0"` that cell in every chunk.

Example:
    model = as_model([chunk0, chunk1])     # ModelChunks; a single model (or a list of one) as it is
    [name for name, _ in model.cells_and_names()]   # ['0:', '0:layers.0', ..., '1:', '1:layers.0', ...]
    split_chunk("1:layers.0.weight")       # (1, 'layers.0.weight'); split_chunk("fc1") == (0, 'fc1')
"""
import re
from typing import Iterator, List, Sequence, Tuple

from mindmon.compat import module_parameters, named_cells

SEPARATOR = ":"
_PREFIXED = re.compile(r"^(\d+):(.*)$", re.S)


def split_chunk(name: str) -> Tuple[int, str]:
    """(chunk, name without the prefix); a name without one is chunk 0's."""
    match = _PREFIXED.match(name)
    return (int(match.group(1)), match.group(2)) if match else (0, name)


def chunk_name(chunk: int, name: str) -> str:
    return f"{chunk}{SEPARATOR}{name}"


def has_chunk(name: str) -> bool:
    return _PREFIXED.match(name) is not None


def names_match(name: str, target: str, prefix_of: bool = False) -> bool:
    """Does `target` name `name` (or, with `prefix_of`, a cell holding it: `target` + "." starts it)? A
    prefixed target must be of the same chunk; a plain one matches in every chunk."""
    chunk, bare = split_chunk(name)
    if has_chunk(target):
        wanted_chunk, target = split_chunk(target)
        if wanted_chunk != chunk:
            return False
    return bare == target or (prefix_of and bare.startswith(target + "."))


class ModelChunks:
    """Several model chunks seen as one model: `cells_and_names()` and `parameters_and_names()` of every
    chunk under `"<c>:"` names, the chunk's root cell as `"<c>:"`. A micro-step begins with chunk 0's
    forward (the first chunk a micro-batch runs through on every stage)."""

    def __init__(self, chunks: Sequence):
        self.chunks = list(chunks)

    def cells_and_names(self) -> Iterator[Tuple[str, object]]:
        for chunk, model in enumerate(self.chunks):
            for name, cell in named_cells(model):
                yield chunk_name(chunk, name), cell

    def parameters_and_names(self) -> Iterator[Tuple[str, object]]:
        for chunk, model in enumerate(self.chunks):
            pairs = model.parameters_and_names() if hasattr(model, "parameters_and_names") \
                else model.named_parameters()
            for name, parameter in pairs:
                yield chunk_name(chunk, name), parameter

    def get_parameters(self) -> List:
        return [parameter for model in self.chunks for parameter in module_parameters(model)]

    def trainable_params(self) -> List:
        return [parameter for model in self.chunks for parameter in model.trainable_params()]

    def register_forward_pre_hook(self, hook):
        return self.chunks[0].register_forward_pre_hook(hook)

    @property
    def training(self) -> bool:
        return any(getattr(model, "training", False) for model in self.chunks)


def as_model(model_or_chunks):
    """A list (or tuple) of several chunks as `ModelChunks`; one model, or a list of one, as it is."""
    if isinstance(model_or_chunks, (list, tuple)):
        if len(model_or_chunks) == 1:
            return model_or_chunks[0]
        return ModelChunks(model_or_chunks)
    return model_or_chunks
