"""mindmon/compat.py on the MindSpore of this environment (2.9 in `make test`, 2.7 in `make test-ms27`, 2.10 in
`make test-ms210`):
the supported-range check is silent, and `narrow`/`split` give numpy's slices whichever kernel runs."""
import logging

import mindspore as ms
import numpy as np
import pytest

from mindmon import compat, extras

pytestmark = pytest.mark.ms27   # also runs on MindSpore 2.7 (make test-ms27)


def test_this_mindspore_is_in_the_supported_range_without_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(extras, "_version_checked", False)
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        assert extras.require_mindspore() is ms
    assert ms.__version__.startswith(("2.7.", "2.9.", "2.10.")) and not caplog.records


def test_narrow_and_split_equal_numpy_slices():
    # MindSpore 2.7 has no CPU kernel for mint.narrow / mint.split: there the fallback is what runs
    assert compat._mint_runs("narrow") == compat._mint_runs("split") == (not ms.__version__.startswith("2.7."))
    values = np.arange(60, dtype=np.float32).reshape(6, 10)
    tensor = ms.Tensor(values)
    np.testing.assert_array_equal(compat.narrow(tensor, 0, 2, 3).asnumpy(), values[2:5])
    np.testing.assert_array_equal(compat.narrow(tensor, 1, 4, 6).asnumpy(), values[:, 4:10])
    pieces = compat.split(tensor, 4, dim=-1)
    assert [p.shape for p in pieces] == [(6, 4), (6, 4), (6, 2)]
    np.testing.assert_array_equal(np.concatenate([p.asnumpy() for p in pieces], -1), values)


def test_a_cells_parameter_names_are_its_own():
    from mindmon.core.names import names_in_model

    dense = ms.nn.Dense(3, 2)
    parameters = dense.trainable_params()
    assert names_in_model(dense, parameters) == [p.name for p in parameters] == ["weight", "bias"]


@pytest.fixture
def fresh_names(monkeypatch):
    """dtype_name's tables empty, as in a fresh process."""
    monkeypatch.setattr(compat, "_DTYPE_NAMES", {})
    monkeypatch.setattr(compat, "_NAMES_BY_IDENTITY", {})


@pytest.mark.parametrize("dtype, name", [(ms.float32, "Float32"), (ms.bfloat16, "BFloat16"), (ms.uint8, "UInt8"),
                                         (ms.bool_, "Bool"), (ms.int64, "Int64")])
def test_dtype_names_are_msprobes_whatever_str_gives(dtype, name, fresh_names):
    for _ in range(2):   # made, then remembered
        assert compat.dtype_name(dtype) == name
        assert compat.dtype_name(repr(dtype)) == name   # what str() gives once mindnlp is imported


class _Dtype:
    """A dtype-like object: hashable by its text, as MindSpore's dtypes are; counts str() and hash()."""

    def __init__(self, text, calls):
        self.text, self.calls = text, calls

    def __str__(self):
        self.calls.append("str")
        return self.text

    def __eq__(self, other):
        return isinstance(other, _Dtype) and other.text == self.text

    def __hash__(self):
        self.calls.append("hash")
        return hash(self.text)


def test_dtype_names_remembered_by_identity_stay_right_for_fresh_objects(fresh_names):
    """Names are remembered by the dtype object's identity (MindSpore's dtypes are one object each): the
    same object gives its name again without hashing it; objects made afresh each time, equal by value,
    get their names from the value table (str() once per value), and no more than a bounded number of
    objects is held; an object that cannot be hashed still gets its name."""
    calls = []
    float16 = _Dtype("mindspore.float16", calls)
    assert compat.dtype_name(float16) == "Float16" and calls.count("str") == 1
    calls.clear()
    assert [compat.dtype_name(float16) for _ in range(3)] == ["Float16"] * 3 and calls == []
    for index in range(200):
        assert compat.dtype_name(_Dtype(("mindspore.float32", "mindspore.int8")[index % 2], calls)) == (
            "Float32", "Int8")[index % 2]
    assert calls.count("str") == 2 and len(compat._NAMES_BY_IDENTITY) == compat._IDENTITIES_KEPT

    class Unhashable:
        __hash__ = None

        def __str__(self):
            return "mindspore.uint8"

    assert compat.dtype_name(Unhashable()) == "UInt8"


def test_float32_memory_gives_what_the_public_attributes_give():
    """Shape and dtype as the tensor gives them; the data pointer only for a contiguous float32 MindSpore
    tensor (a Parameter too) when direct reads are asked for, 0 for anything else; an array standing for a
    tensor (HostTensor) gives its own shape and dtype. Read from MindSpore's C++ class on 2.7 and 2.9."""
    from mindspore._c_expression import TensorPy

    from mindmon.features.tensor_stats.monitor import HostTensor
    from mindmon.kernels.stats import float32_memory

    assert compat.mindspore_types().core is TensorPy
    _check_float32_memory(float32_memory)
    if ms.__version__.startswith("2.9"):
        assert float32_memory(ms.Tensor(np.ones(3, np.float32)), True)[2] != 0
    assert float32_memory(HostTensor(np.zeros((2, 2), np.float32), "Float32"), True) == ((2, 2), "Float32", 0)


def test_float32_memory_reads_the_public_attributes_where_the_cpp_class_differs(monkeypatch):
    """Where MindSpore's C++ class does not give what `_tensor_core` checks (another MindSpore), the public
    attributes are read, with the same answers."""
    from mindmon.kernels.stats import float32_memory

    class Other:
        pass

    monkeypatch.setattr(compat, "_MINDSPORE_TYPES", [compat.MindSporeTypes(ms.Tensor, ms.float32, Other)])
    _check_float32_memory(float32_memory)


def _check_float32_memory(float32_memory):
    base = ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    cases = [(base, True), (ms.Parameter(ms.Tensor(np.ones(5, np.float32)), name="w"), True),
             (ms.ops.transpose(base, (1, 0)), False), (ms.Tensor(np.ones(3, np.int32)), False),
             (ms.Tensor(np.ones(3, np.float64)), False)]
    for tensor, addressed in cases:
        shape, dtype, address = float32_memory(tensor, True)
        assert (shape, dtype) == (tensor.shape, tensor.dtype)
        # (MindSpore 2.7 gives a tensor made from numpy data pointer 0 until an op has run on it)
        assert address == (tensor._data_ptr() if addressed else 0)
        assert float32_memory(tensor, False) == (tensor.shape, tensor.dtype, 0)
    _check_float32_memories([tensor for tensor, _ in cases], [tensor for tensor, addressed in cases if addressed])


def _check_float32_memories(tensors, addressed):
    """`float32_memories` gives, as three lists, what `float32_memory` gives tensor by tensor: for tensors
    all contiguous float32 (its `map`s over the C++ class), with others among them, with an array standing
    for a tensor among them."""
    from mindmon.features.tensor_stats.monitor import HostTensor
    from mindmon.kernels.stats import float32_memories, float32_memory

    mixed = tensors + [HostTensor(np.zeros((2, 2), np.float32), "Float32")]
    for chosen in (addressed, tensors, mixed):
        for direct in (True, False):
            assert list(zip(*float32_memories(chosen, direct))) == [float32_memory(t, direct) for t in chosen]


def test_is_floating_names_the_types_a_gradient_flows_to():
    import mindspore as ms

    from mindmon.compat import is_floating

    floating = [ms.float16, ms.float32, ms.float64, ms.bfloat16]
    others = [ms.int8, ms.int32, ms.int64, ms.uint8, ms.bool_, ms.complex64]
    assert [is_floating(d) for d in floating + others] == [True] * len(floating) + [False] * len(others)
    assert all(is_floating(d) == ms.Tensor([1], d).is_floating_point() for d in floating + others[:-1])


def test_element_count_adds_the_tensors_sizes_however_they_are_read(monkeypatch):
    """`element_count` is the sum of the tensors' element counts: contiguous, strided, 0-dim and empty
    MindSpore tensors, with an array standing for a tensor among them, and where MindSpore's C++ class does
    not give what `_tensor_core` checks."""
    from mindmon.features.tensor_stats.monitor import HostTensor
    from mindmon.kernels.stats import element_count

    base = ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    tensors = [base, base[:, 1:3], ms.Tensor(np.float32(2.0)), ms.Tensor(np.ones((2, 0), np.float32)),
               ms.Tensor(np.ones(5, np.float16))]
    want = 12 + 6 + 1 + 0 + 5
    assert element_count(tensors) == want
    assert element_count(tensors + [HostTensor(np.zeros((2, 3), np.float32), "Float32")]) == want + 6

    class Other:
        pass

    monkeypatch.setattr(compat, "_MINDSPORE_TYPES", [compat.MindSporeTypes(ms.Tensor, ms.float32, Other)])
    assert element_count(tensors) == want


def test_requires_grad_is_told_where_mindspore_tracks_it():
    """2.9 and later: a gradient computation's inputs say `_requires_grad` True inside it, a tensor made
    outside says False; 2.7 says False for every tensor, so it tells nothing."""
    from mindmon.compat import requires_grad_is_told

    assert requires_grad_is_told() == (not ms.__version__.startswith("2.7"))
    inside = []
    ms.grad(lambda x: inside.append(bool(x._requires_grad)) or x * 2.0)(ms.Tensor([1.0], ms.float32))
    assert inside == [requires_grad_is_told()]
