"""Differences between the MindSpore versions mindmon supports, and mindnlp's changes to MindSpore.

Every shim mindmon needs lives here, each with the reason it exists (docs/mindnlp.md):

- MindSpore 2.7 has no CPU kernel for `mint.narrow` (NarrowExt) and `mint.split` (SplitTensor):
  `narrow` and `split` fall back to `ops.narrow` and `ops.split`, which have one.
- MindSpore 2.7 accepts only functions and bound methods as cell hooks (no callable objects).
- `import mindnlp` (through its `mindtorch` package) replaces methods of `mindspore.Tensor` process-wide
  with PyTorch-style ones: `max(axis=...)` returns (values, indices), `transpose` takes two axes, and
  the arithmetic operators check a `device` tag that tensors made by MindSpore itself (the gradients of
  `value_and_grad`, `ops.narrow`'s output) do not carry. `with_device_of` gives them the tag; the
  max-logit probe uses MindSpore's functional ops only, which these patches do not touch.
- mindnlp's modules list their children with `named_modules()` (MindSpore cells: `cells_and_names()`),
  its parameters carry random names, its `Tensor.register_hook` fails on its own parameters and
  `str(dtype)` becomes `mindspore.float32`: `named_cells`, `parameter_names`, `register_gradient_hook`
  and `dtype_name` work either way.
"""
import functools
import sys
from typing import Iterator, NamedTuple, Tuple

_has_cpu_kernel = {}


def _mint_runs(name: str) -> bool:
    """True when `mint.<name>` runs here (MindSpore 2.7 has no CPU kernel for mint.narrow and mint.split).
    Tried once on a tiny tensor and read back, so that a launch failure, which is asynchronous without
    `pynative_synchronize`, surfaces now and not at exit."""
    if name not in _has_cpu_kernel:
        import numpy as np
        from mindspore import Tensor, mint

        trial = Tensor(np.arange(4, dtype=np.float32))
        try:
            result = mint.narrow(trial, 0, 1, 2) if name == "narrow" else mint.split(trial, 2, dim=-1)[1]
            _has_cpu_kernel[name] = bool(result.asnumpy()[0] in (1, 2))
        except Exception:   # "Not found op ... on device CPU"
            _has_cpu_kernel[name] = False
    return _has_cpu_kernel[name]


def narrow(tensor, dim: int, start: int, length: int):
    """`length` entries of `dim` from `start` (mint.narrow, or ops.narrow where mint's has no kernel)."""
    from mindspore import mint, ops

    return (mint.narrow if _mint_runs("narrow") else ops.narrow)(tensor, dim, start, length)


def split(tensor, size: int, dim: int = -1):
    """Pieces of `size` along `dim` (mint.split, or ops.split where mint's has no kernel)."""
    from mindspore import mint, ops

    return mint.split(tensor, size, dim=dim) if _mint_runs("split") else ops.split(tensor, size, dim)


def named_cells(model) -> Iterator[Tuple[str, object]]:
    """(name, cell) for every cell of a MindSpore model or module of a mindnlp (PyTorch-style) model."""
    if hasattr(model, "cells_and_names"):
        return model.cells_and_names()
    return model.named_modules()


def module_parameters(cell):
    """The parameters of a cell (MindSpore) or module (mindnlp), its children's included."""
    if hasattr(cell, "get_parameters"):
        return cell.get_parameters()
    return cell.parameters()


def with_device_of(tensors, references) -> tuple:
    """With mindnlp loaded, the tensors MindSpore makes itself (the gradients and auxiliary outputs of
    `value_and_grad`) lack the `device` tag mindnlp's Tensor methods require ("Tensor must have device"
    at the first `+`). Each tensor without one gets the tag of its reference (its parameter), so that
    mindmon's arithmetic and the user's optimizer both work on them. Without mindnlp: unchanged."""
    tensors = tuple(tensors)
    if "mindtorch" not in sys.modules:
        return tensors
    for tensor, reference in zip(tensors, references):
        device = getattr(reference, "_device", None)
        if device is not None and getattr(tensor, "_device", None) is None:
            tensor._device = device
    return tensors


def register_gradient_hook(tensor, hook):
    """`tensor.register_hook(hook)`: the hook receives the tensor's gradient. mindnlp replaces
    `Tensor.register_hook` with one that fails on its own parameters (it reads a `_data` they do not
    have), so with mindnlp loaded MindSpore's implementation is called directly."""
    if "mindtorch" not in sys.modules:
        return tensor.register_hook(hook)
    from mindspore._c_expression import TensorPy
    from mindspore.common.hook_handle import _TensorHookHandle

    handle = _TensorHookHandle(tensor)
    handle.id = TensorPy.register_hook(tensor, hook)
    return handle


@functools.lru_cache(maxsize=None)
def builtin_hooks_accepted() -> bool:
    """Whether a gradient hook may be a built-in callable (a list's `append`): MindSpore 2.9 takes any
    callable, 2.7 Python functions and methods only. Asked of MindSpore itself, once: a hook registered on
    a one-element Parameter and removed."""
    import mindspore

    try:
        handle = register_gradient_hook(mindspore.Parameter(mindspore.Tensor([0.0]), name="mindmon_probe"), [].append)
    except (TypeError, RuntimeError, ValueError):
        return False
    handle.remove()
    return True


@functools.lru_cache(maxsize=None)
def requires_grad_is_told() -> bool:
    """Whether MindSpore's `_requires_grad` tells which tensors its autograd tracks: on 2.9 a gradient
    computation's inputs say True inside it and a tensor made outside one says False (no gradient can reach
    that tensor); 2.7 says False for every tensor. Asked of MindSpore itself, once: one gradient of a
    one-element function."""
    import mindspore

    seen = []

    def probe(x):
        seen.append(bool(getattr(x, "_requires_grad", False)))
        return x * 2.0

    try:
        outside = mindspore.Tensor([1.0], mindspore.float32)
        mindspore.grad(probe)(mindspore.Tensor([1.0], mindspore.float32))
        return seen == [True] and not getattr(outside, "_requires_grad", True)
    except Exception:   # noqa: BLE001 - any failure: not told, every tensor treated as tracked
        return False


def dtype_name(dtype) -> str:
    """MindSpore's name of a dtype, `Float32` (what msprobe's CSV files hold). mindnlp makes `str()` of a
    dtype its repr, `mindspore.float32`; that is turned back into the name. Remembered per dtype: it is
    asked for every tensor a hook sees. MindSpore hands out one object per dtype, so the look-up is by
    identity first (hashing a dtype calls into MindSpore: 4.3 -> 3.3 us for a tensor's shape and dtype text, warm), then by
    value."""
    known = _NAMES_BY_IDENTITY.get(id(dtype))
    if known is not None and known[0] is dtype:
        return known[1]
    try:
        name = _DTYPE_NAMES.get(dtype)
    except TypeError:   # not hashable: nothing to remember it by
        return _name_of(str(dtype))
    if name is None:
        name = _DTYPE_NAMES[dtype] = _name_of(str(dtype))
    if len(_NAMES_BY_IDENTITY) < _IDENTITIES_KEPT:   # bounded, should dtypes ever be fresh objects
        _NAMES_BY_IDENTITY[id(dtype)] = (dtype, name)   # holds the object: its id is not reused
    return name


def is_float32(dtype) -> bool:
    """MindSpore's float32 object by identity first: asked for every tensor a hook sees."""
    return dtype is mindspore_types().float32 or dtype_name(dtype) == "Float32"


_FLOATING = frozenset(("Float16", "Float32", "Float64", "BFloat16"))


def is_floating(dtype) -> bool:
    """Whether a MindSpore dtype is a floating type (what a gradient flows to), float32 by identity first."""
    return dtype is mindspore_types().float32 or dtype_name(dtype) in _FLOATING


class MindSporeTypes(NamedTuple):
    tensor: type
    float32: object
    # The C++ class under `Tensor` (and `Parameter`), whose own attributes `Tensor.shape`, `.dtype`,
    # `.is_contiguous()` and `._data_ptr()` only wrap in Python (MindSpore 2.7 and 2.9): `_shape`,
    # `_dtype`, `core.is_contiguous(t)`, `core._data_ptr(t)` give the same, without a Python frame each (in
    # a hook's context each frame costs microseconds). A class nothing is an instance of where they differ.
    core: type


_MINDSPORE_TYPES = []


def mindspore_types() -> MindSporeTypes:
    """`mindspore.Tensor` and `mindspore.float32`, imported once: hooks ask for them at every tensor, and an
    import statement there costs microseconds."""
    if not _MINDSPORE_TYPES:
        import mindspore

        _MINDSPORE_TYPES.append(MindSporeTypes(mindspore.Tensor, mindspore.float32, _tensor_core(mindspore)))
    return _MINDSPORE_TYPES[0]


class _NoCore:
    """Stands for the C++ tensor class where its attributes are not what `_tensor_core` checks."""


def _tensor_core(mindspore) -> type:
    core = mindspore.Tensor.__mro__[1]
    try:
        probe = mindspore.Tensor([[0.0, 0.0]], mindspore.float32)
        same = (isinstance(probe, core) and probe._shape == probe.shape and probe._dtype is probe.dtype
                and core.is_contiguous(probe) == probe.is_contiguous() and callable(core._data_ptr)
                and probe._size == 2)
    except Exception:   # noqa: BLE001 - any difference means: the public attributes
        same = False
    return core if same else _NoCore


_DTYPE_NAMES: dict = {}
_NAMES_BY_IDENTITY: dict = {}
_IDENTITIES_KEPT = 64


def _name_of(text: str) -> str:
    if not text.startswith("mindspore."):
        return text
    name = text[len("mindspore."):].rstrip("_")
    special = {"bfloat16": "BFloat16", "bool": "Bool"}
    if name in special:
        return special[name]
    return "UInt" + name[4:] if name.startswith("uint") else name[:1].upper() + name[1:]
