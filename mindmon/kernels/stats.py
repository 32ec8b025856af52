"""Batched tensor statistics with no host sync per tensor.

On CPU, `Tensor.asnumpy()` returns a view of the tensor's memory, so squared norms are taken in
numpy: no kernel dispatch per parameter. Elsewhere the tensors of one call are reduced on the device
together, in a few MindSpore operations whatever their number (`mindmon/kernels/device.py`), and
copied to the host once, when `results()` is read at flush.

Example:
    norms = SquaredNorms(on_host=True)
    norms.add(("accumulated", 0), grads)
    norms.results()[("accumulated", 0)]  # np.ndarray, one float64 per tensor
"""
import ctypes
import math
from itertools import repeat
from operator import and_, attrgetter, is_
from typing import Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from mindmon.compat import dtype_name, is_float32, mindspore_types
from mindmon.kernels.device import DeviceRows, device_squared_norms, read_all
from mindmon.kernels.one_pass import add_and_squares, prepare


def host_is_device() -> bool:
    """True when tensors live in host memory (MindSpore's CPU target)."""
    from mindmon.extras import require_mindspore

    ms = require_mindspore()

    return ms.get_context("device_target") == "CPU"


# Elements per float32 partial sum (256 KiB: stays in cache while BLAS reads it).
_BLOCK = 1 << 16
# Arrays up to this size are summed in float64 (a copy of at most 32 KiB).
SMALL = 1 << 12


def host_array(tensor, direct: bool = False, dtype: Optional[str] = None) -> np.ndarray:
    """The tensor's elements as a flat numpy array, to read: on CPU a view of a contiguous tensor's memory
    (a strided tensor's elements are copied; bfloat16 goes through a float32 copy, numpy has no bfloat16). A numpy array (a view the training step already holds) is taken as it is.
    `direct` (see `direct_views_allowed`): build the view from the data pointer where that is safe.
    `dtype`: the tensor's dtype name (`dtype_name`), when the caller has read it already."""
    if isinstance(tensor, np.ndarray):
        return tensor.reshape(-1)
    if direct:   # one dtype read: MindSpore's dtype comparisons cost microseconds each
        view = direct_view(tensor, dtype or dtype_name(tensor.dtype))
        if view is not None:
            return view
    import mindspore as ms

    if tensor.dtype == ms.bfloat16:
        # A copy anyway (numpy has no bfloat16): float64, so that the sum is not float32 BLAS blocks of
        # 8-bit-mantissa values, whose rounding errors do not cancel (about 4e-6 relative).
        return tensor.astype(ms.float32).asnumpy().reshape(-1).astype(np.float64)
    return tensor.asnumpy().reshape(-1)


def direct_views_allowed() -> bool:
    """May `host_array(..., direct=True)` read a tensor's memory through its data pointer? Only on CPU
    with synchronous execution (`pynative_synchronize`), where a tensor a hook sees is already computed;
    asynchronous execution needs asnumpy's wait. Not before MindSpore 2.8: 2.7 logs an error for a tensor
    whose host memory has no device address yet. Costs ~0.3 ms (context reads): ask once per step."""
    import mindspore as ms

    version = tuple(int(p) for p in ms.__version__.split(".")[:2] if p.isdigit())
    return (version >= (2, 8) and ms.get_context("device_target") == "CPU"
            and bool(ms.get_context("pynative_synchronize")))


class StepDirectViews:
    """`direct_views_allowed()`, read at most once per step (its context reads cost about 0.3 ms; a step
    collects hundreds of tensors); `forget()` at the step's end reads the execution mode again next step."""

    def __init__(self):
        self._allowed: Optional[bool] = None

    def allowed(self) -> bool:
        if self._allowed is None:
            self._allowed = direct_views_allowed()
        return self._allowed

    def forget(self) -> None:
        self._allowed = None


_DTYPES: Dict[str, np.dtype] = {name: np.dtype(code) for name, code in (
    ("Float32", "<f4"), ("Float16", "<f2"), ("Float64", "<f8"), ("Int32", "<i4"), ("Int64", "<i8"),
    ("Int16", "<i2"), ("Int8", "|i1"), ("UInt8", "|u1"), ("Bool", "|b1"))}


def addressable(tensor) -> bool:
    """Whether a CPU tensor's elements lie in order at its data pointer (which includes the storage
    offset): a MindSpore tensor (it gives the pointer), contiguous. Only where `direct_views_allowed()`.
    One not initialised yet (a Tensor made with an initializer; Parameters made from one are initialised
    when made, here) is contiguous but has no memory: it gives data pointer 0, which every caller refuses
    (measured on MindSpore 2.9 and tested), so it is not asked for separately: each attribute read in a
    hook costs microseconds."""
    return hasattr(tensor, "_data_ptr") and tensor.is_contiguous()


def float32_memory(tensor, direct: bool) -> Tuple[object, object, int]:
    """A tensor's shape and dtype objects, and, with `direct` (see `direct_views_allowed`), the data
    pointer of a contiguous float32 MindSpore tensor (0 for any other, and for one with no memory yet,
    as `addressable` says). For every tensor a hook sees: MindSpore's C++ attributes are read without
    Tensor's Python wrappers (`compat.MindSporeTypes.core`), each a frame that costs microseconds in a
    hook's context."""
    _, float32, core = mindspore_types()
    if isinstance(tensor, core):
        shape, dtype = tensor._shape, tensor._dtype
        if direct and (dtype is float32 or dtype_name(dtype) == "Float32") and core.is_contiguous(tensor):
            return shape, dtype, core._data_ptr(tensor)
        return shape, dtype, 0
    shape, dtype = tensor.shape, tensor.dtype   # through the wrappers: another tensor type, a HostTensor
    if direct and is_float32(dtype) and addressable(tensor):
        return shape, dtype, tensor._data_ptr()
    return shape, dtype, 0


def float32_memories(tensors: Sequence, direct: bool) -> Tuple[List, List, List[int]]:
    """`float32_memory` of each of `tensors`, as three lists: shapes, dtypes, data pointers (0 where
    `float32_memory` gives 0). When every tensor is a MindSpore tensor each list comes from one `map` over a
    C++ attribute or method: no Python frame per tensor (a step's hundreds of gradients, read in a hook
    where every frame costs several times its warm time); tensors of another type or dtype, or not
    contiguous, are looked at one by one."""
    _, float32, core = mindspore_types()
    count = len(tensors)
    if not all(map(isinstance, tensors, repeat(core))):
        found = [float32_memory(tensor, direct) for tensor in tensors]
        return [m[0] for m in found], [m[1] for m in found], [m[2] for m in found]
    shapes, dtypes = list(map(_SHAPE, tensors)), list(map(_DTYPE, tensors))
    if not direct:
        return shapes, dtypes, [0] * count
    plain = list(map(and_, map(is_, dtypes, repeat(float32)), map(core.is_contiguous, tensors)))
    if plain.count(True) == count:
        return shapes, dtypes, list(map(core._data_ptr, tensors))
    return shapes, dtypes, [float32_memory(tensor, direct)[2] for tensor in tensors]


_SHAPE, _DTYPE = attrgetter("_shape"), attrgetter("_dtype")


def element_count(tensors: Sequence) -> int:
    """How many elements the tensors hold together: MindSpore's C++ `_size` of a MindSpore tensor, the
    shape's product of any other. A plain loop: a hook hands one or two tensors, too few for `map`s to pay."""
    core, count = mindspore_types().core, 0
    for tensor in tensors:
        count += tensor._size if isinstance(tensor, core) else math.prod(tensor.shape)
    return count


def float32_runs(tensor) -> Optional[Tuple[int, int, int, int]]:
    """(address, runs, run length, stride between run starts) of a strided float32 CPU tensor whose elements
    lie in equal runs: its last dimension contiguous, the ones before it one stride apart (a slice of a
    wider tensor's last dimension); None for any other layout, or one with no memory. Only where
    `direct_views_allowed()`, for a tensor `float32_memory` gave no address."""
    if not hasattr(tensor, "_data_ptr"):
        return None
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if len(shape) < 2 or strides[-1] != 1 or any(strides[i] != strides[i + 1] * shape[i + 1]
                                                 for i in range(len(shape) - 2)):
        return None
    runs, length = math.prod(shape[:-1]), shape[-1]
    address = tensor._data_ptr() if runs and length else 0
    return (address, runs, length, strides[-2]) if address else None


def direct_view(tensor, name: str):
    """A flat numpy array of a CPU tensor's elements read at its data pointer, or None where `asnumpy()` is
    needed (lazily initialised Parameters, other dtypes, negative strides). `name`: the tensor's dtype as
    `dtype_name` gives it. A contiguous tensor gives a view of its memory; a strided one (a slice of a fused
    projection's output, a transpose) a copy in its elements' order, made by numpy from a strided view.
    Why: `asnumpy()` builds its array through a PEP 3118 buffer whose format string numpy parses in Python,
    40-100 us per call, and of a strided tensor it first makes a contiguous copy in MindSpore (0.3-0.4 ms
    for 64K float32 elements here, 15% of the time in the activation hooks); this costs a few
    microseconds (a ctypes buffer at the address: half the time of numpy's array interface)."""
    dtype = _DTYPES.get(name)
    if dtype is None or not hasattr(tensor, "_data_ptr"):
        return None
    size = int(tensor.size)
    if not size:
        return np.empty(0, dtype=dtype)
    pointer = tensor._data_ptr()
    if not pointer:   # MindSpore 2.7: 0 for a tensor built from numpy whose device address is not set yet
        return None
    if tensor.is_contiguous():
        return _array_at(pointer, size, dtype, tensor)
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if min(strides) < 0:
        return None
    extent = 1 + sum((n - 1) * stride for n, stride in zip(shape, strides))   # elements from the first to the last
    strided = np.lib.stride_tricks.as_strided(_array_at(pointer, extent, dtype, tensor), shape,
                                              [stride * dtype.itemsize for stride in strides], writeable=False)
    return strided.reshape(-1)   # a copy: the elements in order


def _array_at(pointer: int, size: int, dtype: np.dtype, tensor) -> np.ndarray:
    """`size` elements at `pointer` as a numpy array that holds `tensor` (its memory is not freed under it)."""
    memory = (ctypes.c_char * (size * dtype.itemsize)).from_address(pointer)
    memory.owner = tensor
    return np.frombuffer(memory, dtype)


def _squared_norm(flat: np.ndarray) -> float:
    """Sum of squares, reading the array once and never copying a large one.

    A float32 array is summed by BLAS in blocks of 65536 elements (float32 accumulation: relative
    error about 1e-7, the precision of float32 gradients themselves), the blocks added in float64.
    Converting to float64 first would allocate a fresh copy each time and take several times as long,
    which, a few times per micro-step for every parameter, was most of the monitor's cost. Small
    arrays are summed in float64.
    """
    if flat.dtype == np.float32 and flat.size > SMALL:
        total = 0.0
        for start in range(0, flat.size, _BLOCK):
            block = flat[start:start + _BLOCK]
            total += float(np.dot(block, block))
        return total
    flat = flat.astype(np.float64, copy=False)
    return float(np.dot(flat, flat))


class SquaredNorms:
    """Collects the squared L2 norm of every tensor in a list, per key; one transfer per key at most."""

    def __init__(self, on_host: bool):
        self.on_host = on_host
        self._pending: Dict[Hashable, object] = {}

    def add(self, key: Hashable, tensors: Sequence) -> None:
        if not tensors:
            return
        if self.on_host or isinstance(tensors[0], np.ndarray):
            self._pending[key] = np.array([_squared_norm(host_array(t)) for t in tensors], dtype=np.float64)
        else:
            self._pending[key] = device_squared_norms(tensors)

    def put(self, key: Hashable, squared_norms: np.ndarray) -> None:
        """`key` gets squared norms taken elsewhere (the training step's host buffer, while adding)."""
        self._pending[key] = squared_norms

    def alias(self, key: Hashable, existing: Hashable) -> None:
        """`key` gets the norms already taken for `existing` (the same tensors), without reading them again."""
        if existing in self._pending:
            self._pending[key] = self._pending[existing]

    def results(self) -> Dict[Hashable, np.ndarray]:
        """Every key's squared norms as float64 arrays; the device tensors of all keys reach the host in
        one transfer (an aliased one once)."""
        device = list({id(v): v for v in self._pending.values() if isinstance(v, DeviceRows)}.values())
        host = {id(v): rows for v, rows in zip(device, read_all(device))}
        return {key: host[id(value)] if isinstance(value, DeviceRows) else value
                for key, value in self._pending.items()}

    def clear(self) -> None:
        self._pending.clear()


def to_float(value) -> float:
    """A Python float from a float, numpy scalar or 0-dim tensor (one host read)."""
    if hasattr(value, "asnumpy"):
        return float(value.asnumpy())
    return float(value)


class MicroStepNorms(NamedTuple):
    """Squared L2 norms after one micro-step, one float64 per parameter: of the micro-batch's own
    gradient and of the gradient accumulated so far."""

    micro: np.ndarray
    accumulated: np.ndarray


def _add_and_square(view: np.ndarray, flat: np.ndarray, first: bool) -> Tuple[float, float]:
    """`view += flat` (or `view[:] = flat` when `first`); returns (|view|^2 after, |flat|^2), small arrays
    summed in float64, large ones in one compiled pass (`one_pass.add_and_squares`)."""
    if view.size <= SMALL:
        with np.errstate(invalid="ignore", over="ignore"):   # inf + -inf of an overflowed step: NaN, said by loss_scale
            np.copyto(view, flat) if first else np.add(view, flat, out=view)
        return _squared_norm(view), (0.0 if first else _squared_norm(flat))
    return add_and_squares(view, flat, first)


class HostGradientBuffer:
    """CPU, float32 parameters: the step's accumulated gradients in one numpy buffer, a view per parameter.

    On CPU a MindSpore tensor's `asnumpy()` is a view of its memory, so adding a micro-batch's gradients
    here reads each gradient once and costs one numpy add, where accumulating as MindSpore ops costs one
    dispatch and one new tensor per parameter. The monitors then take norms of these views without any
    further host read. A fresh buffer per step: the previous step's tensors handed to the optimizer
    (`tensors()`, zero-copy) are never overwritten.
    """

    def __init__(self, parameters: Sequence):
        prepare()   # numba's loops now, not in the first step
        self.shapes = [tuple(p.shape) for p in parameters]
        sizes = [int(np.prod(shape)) if shape else 1 for shape in self.shapes]
        self.offsets = np.cumsum([0] + sizes)
        self.views: list = []

    @staticmethod
    def fits(parameters: Sequence) -> bool:
        import mindspore as ms

        return bool(parameters) and all(p.dtype == ms.float32 for p in parameters)

    def add(self, grads: Sequence, with_norms: bool = False) -> Tuple[list, Optional["MicroStepNorms"]]:
        """Adds one micro-batch's gradients. Returns them as flat numpy views (valid while `grads` lives)
        and, with `with_norms`, the squared norms of each one and of each accumulated sum.

        The norms are taken in the add's own pass (`one_pass.add_and_squares`): reading 42 MB of
        gradients again for each norm cost more than the add itself.
        """
        micro = [g.asnumpy().reshape(-1) for g in grads]
        first = not self.views
        if first:
            buffer = np.empty(int(self.offsets[-1]), np.float32)
            self.views = [buffer[start:end] for start, end in zip(self.offsets[:-1], self.offsets[1:])]
        if not with_norms:
            for view, flat in zip(self.views, micro):
                np.copyto(view, flat) if first else np.add(view, flat, out=view)
            return micro, None
        accumulated = np.array([_add_and_square(view, flat, first) for view, flat in zip(self.views, micro)])
        if first:  # the accumulated sum is the micro-batch's gradient
            return micro, MicroStepNorms(accumulated[:, 0], accumulated[:, 0])
        return micro, MicroStepNorms(accumulated[:, 1], accumulated[:, 0])

    def scale(self, factor: float) -> None:
        for view in self.views:
            view *= np.float32(factor)

    def take(self) -> tuple:
        """The accumulated gradients as MindSpore tensors sharing the buffer; the next `add` starts a new one."""
        from mindspore import Tensor

        tensors = tuple(Tensor.from_numpy(view.reshape(shape)) for view, shape in zip(self.views, self.shapes))
        self.views = []
        return tensors
