"""grad_unreduced's host sums (`mindmon.msprobe.accumulate.GradientSums`): float32 gradients are added
from their data pointers when execution is synchronous, everything else through numpy; both give the
numpy sum of the micro-batch gradients, and a gradient whose size does not match the sum is refused,
never read past its end."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindmon.msprobe.accumulate import GradientSums
from mindmon.one_pass import add_at


def _sums(direct: bool) -> GradientSums:
    sums = GradientSums(on_host=True, per_micro_batch=False, on_micro_gradient=None)
    sums.direct_views.allowed = lambda: direct   # the per-step answer of direct_views_allowed()
    return sums


def _micro_batches(rng, shape, dtype, count=3):
    return [rng.normal(0.1 * k, 1.0 + k, size=shape).astype(dtype) for k in range(count)]


@pytest.mark.parametrize("direct", [True, False])
def test_sums_equal_numpy_for_every_dtype_and_layout(rng, direct, monkeypatch):
    cases = {
        "float32": [Tensor(a) for a in _micro_batches(rng, (33, 129), np.float32)],
        "float32_scalar": [Tensor(a) for a in _micro_batches(rng, (), np.float32)],
        "float16": [Tensor(a) for a in _micro_batches(rng, (7, 5), np.float16)],
        # a transposed view: not contiguous, so never read at its pointer
        "float32_transposed": [Tensor(a).transpose(1, 0) for a in _micro_batches(rng, (6, 4), np.float32)],
    }
    from mindmon.msprobe import accumulate

    by_address = []

    def counted_add_at(total, address, first):
        by_address.append(total.size)
        add_at(total, address, first)

    monkeypatch.setattr(accumulate, "add_at", counted_add_at)
    sums = _sums(direct)
    for micro_step in range(3):
        for index, (name, grads) in enumerate(cases.items()):
            sums.add(index, name, grads[micro_step])
    found = dict(sums.named_sums())
    assert list(found) == list(cases)
    # contiguous float32 gradients only are read at their address, and only when that is allowed
    assert by_address == ([33 * 129, 1] * 3 if direct else [])
    for name, grads in cases.items():
        micro = [g.asnumpy() for g in grads]
        if micro[0].dtype == np.float32:   # summed in float32, in order, as a training step adds
            expected = micro[0].copy()
            for m in micro[1:]:
                expected = expected + m
            assert found[name].array.dtype == np.float32 and np.array_equal(found[name].array, expected), name
        else:                              # others in float64
            expected = sum(m.astype(np.float64) for m in micro)
            assert found[name].array.dtype == np.float64
            np.testing.assert_allclose(found[name].array, expected, rtol=1e-12, err_msg=name)
        assert found[name].shape == micro[0].shape
        assert found[name].dtype == ("Float16" if name == "float16" else "Float32")


def test_the_first_gradient_is_copied_not_referenced(rng):
    """A loop may accumulate into the first micro-batch's gradient in place: the sum must not change."""
    first, second = _micro_batches(rng, (64, 65), np.float32, count=2)
    sums = _sums(direct=True)
    tensor = Tensor(first.copy())
    sums.add(0, "w", tensor)
    tensor.asnumpy()[...] = 1e6          # the caller's buffer changes under it
    sums.add(0, "w", Tensor(second))
    assert np.array_equal(sums.named_sums()[0][1].array, first + second)


@pytest.mark.parametrize("direct", [True, False])
def test_a_gradient_of_another_size_is_refused_and_nothing_is_read_past_it(rng, direct):
    sums = _sums(direct)
    first = _micro_batches(rng, (100,), np.float32, count=1)[0]
    sums.add(0, "w", Tensor(first))
    with pytest.raises(ValueError):
        sums.add(0, "w", Tensor(np.ones(10, np.float32)))
    assert np.array_equal(sums.named_sums()[0][1].array, first)   # the sum so far is untouched
    sums.add(0, "w", Tensor(np.ones((10, 10), np.float32)))        # the same size in another shape adds
    assert np.array_equal(sums.named_sums()[0][1].array, first + 1)


def test_the_sums_memory_is_reused_from_step_to_step(rng):
    sums = _sums(direct=True)
    for step in range(2):
        grads = _micro_batches(rng, (50, 3), np.float32, count=2)
        for grad in grads:
            sums.add(0, "w", Tensor(grad))
        array = sums.named_sums()[0][1].array
        assert np.array_equal(array, grads[0] + grads[1])
        if step == 0:
            kept = array
        else:
            assert array is kept
        sums.clear()
