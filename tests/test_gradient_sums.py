"""grad_unreduced's host sums (`mindmon.features.tensor_stats.accumulate.GradientSums`): float32 gradients are added
from their data pointers when execution is synchronous, everything else through numpy; both give the
numpy sum of the micro-batch gradients, and a gradient whose size does not match the sum is refused,
never read past its end."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindmon.kernels import stats
from mindmon.features.tensor_stats.accumulate import GradientSums
from mindmon.kernels.one_pass import add_at


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
    from mindmon.features.tensor_stats import accumulate

    by_address = []

    def counted_add_at(total, address, first):
        by_address.append(total.size)
        add_at(total, address, first)

    monkeypatch.setattr(accumulate, "add_at", counted_add_at)
    pointer_views = []
    view = stats.direct_view
    monkeypatch.setattr(stats, "direct_view", lambda *args: (pointer_views.append(args[1]), view(*args))[1])
    sums = _sums(direct)
    for micro_step in range(3):
        for index, (name, grads) in enumerate(cases.items()):
            sums.add(index, name, grads[micro_step])
    found = dict(sums.named_sums())
    assert list(found) == list(cases)
    # contiguous float32 gradients only are read at their address, and only when that is allowed
    assert by_address == ([33 * 129, 1] * 3 if direct else [])
    # the others are offered to the pointer view (which refuses the transposed one) only where pointers may
    # be read: with asynchronous execution everything goes through asnumpy()
    assert pointer_views == (["Float16", "Float32"] * 3 if direct else [])
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
    with pytest.raises(ValueError, match=r"a gradient of 10 elements, \(10,\), for a sum of 100"):
        sums.add(0, "w", Tensor(np.ones(10, np.float32)))
    assert np.array_equal(sums.named_sums()[0][1].array, first)   # the sum so far is untouched
    sums.add(0, "w", Tensor(np.ones((10, 10), np.float32)))        # the same size in another shape adds
    assert np.array_equal(sums.named_sums()[0][1].array, first + 1)


def test_each_parameter_has_its_own_memory_reused_from_step_to_step(rng):
    """Two parameters of one shape never share a sum; each keeps its memory across steps; a parameter whose
    shape changes gets memory of the new shape."""
    sums = _sums(direct=True)
    kept = None
    for step, shape in enumerate([(50, 3), (50, 3), (7,)]):
        grads = {name: _micro_batches(rng, shape, np.float32, count=2) for name in ("a", "b")}
        for micro_step in range(2):
            for index, name in enumerate(grads):
                sums.add(index, name, Tensor(grads[name][micro_step]))
        found = dict(sums.named_sums())
        for name, (first, second) in grads.items():
            assert found[name].array.shape == shape and np.array_equal(found[name].array, first + second)
        arrays = [found["a"].array, found["b"].array]
        assert not np.shares_memory(*arrays)
        if step == 1:
            assert np.shares_memory(arrays[0], kept[0]) and np.shares_memory(arrays[1], kept[1])
        if step == 2:
            assert not np.shares_memory(arrays[0], kept[0])
        kept = arrays
        sums.clear()
    sums.release()
    assert sums.named_sums() == [] and sums._buffers == {}


def test_per_micro_batch_gradients_go_out_as_they_come_with_their_micro_step(rng):
    seen = []
    sums = GradientSums(on_host=True, per_micro_batch=True,
                        on_micro_gradient=lambda name, grad, micro_step: seen.append((name, micro_step, grad)))
    grads = {name: [Tensor(g) for g in _micro_batches(rng, (4, 3), np.float32)] for name in ("a", "b")}
    for micro_step in range(3):
        for index, name in enumerate(grads):
            sums.add(index, name, grads[name][micro_step])
    assert [(name, micro_step) for name, micro_step, _ in seen] == [
        ("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert all(grad is grads[name][micro_step] for name, micro_step, grad in seen)
    assert sums.named_sums() == []   # nothing summed
    sums.clear()
    sums.add(0, "a", grads["a"][0])
    assert seen[-1][:2] == ("a", 0)  # a new step counts from 0 again


def test_on_the_device_the_sum_stays_a_tensor(rng):
    sums = GradientSums(on_host=False, per_micro_batch=False, on_micro_gradient=None)
    micro = _micro_batches(rng, (5, 6), np.float32)
    for grad in micro:
        sums.add(0, "w", Tensor(grad))
    (name, total), = sums.named_sums()
    assert name == "w" and isinstance(total, Tensor)
    np.testing.assert_allclose(total.asnumpy(), micro[0] + micro[1] + micro[2], rtol=1e-6)


def test_a_count_other_than_grad_acc_steps_is_said_once(rng, caplog):
    sums = _sums(direct=True)
    grad = Tensor(_micro_batches(rng, (3,), np.float32, count=1)[0])
    for step in range(3):
        for micro_step in range(2):
            sums.add(0, "a", grad)
        sums.add(1, "b", grad)                  # b's hook fired once only
        with caplog.at_level("WARNING", logger="mindmon"):
            sums.check_count(2, step)
        sums.clear()
    warnings = [r.getMessage() for r in caplog.records if "micro-batch gradients" in r.getMessage()]
    assert warnings == ["mindmon: step 0: parameters got [1, 2] micro-batch gradients, grad_acc_steps is 2; "
                        "grad_unreduced sums what came"]
    caplog.clear()
    fresh = _sums(direct=True)
    for micro_step in range(2):
        fresh.add(0, "a", grad)
    with caplog.at_level("WARNING", logger="mindmon"):
        fresh.check_count(2, 0)                 # as expected: nothing said
        fresh.check_count(2, 1)                 # nothing came at all: nothing said
    assert not caplog.records
