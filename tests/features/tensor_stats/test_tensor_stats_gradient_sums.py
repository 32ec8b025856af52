"""grad_unreduced's host sums (`mindmon.features.tensor_stats.accumulate.GradientSums`): float32 gradients are added
from their data pointers when execution is synchronous, everything else through numpy; both give the
numpy sum of the micro-batch gradients, and a gradient whose size does not match the sum is refused,
never read past its end."""
import numpy as np
import pytest
from mindspore import Tensor

from mindmon.kernels import stats
from mindmon.features.tensor_stats.accumulate import GradientSums
from mindmon.kernels.one_pass import adds_at


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

    def counted_adds_at(table, *args):
        by_address.extend(table[2::5].tolist())   # the size of each gradient added at its address
        return adds_at(table, *args)

    monkeypatch.setattr(accumulate, "adds_at", counted_adds_at)
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


def test_on_the_device_a_micro_batch_is_added_when_its_last_hook_comes(rng):
    """The device path queues as the host path does: nothing is added until every hooked parameter has
    given its gradient, then the micro-batch goes into the flat sum at once; the sums are numpy's."""
    sums = GradientSums(on_host=False, per_micro_batch=False, on_micro_gradient=None)
    sums.expect(2, 2, None)
    micro = [{name: _micro_batches(rng, shape, np.float32, count=1)[0] for name, shape in (("a", (4, 3)), ("b", (5,)))}
             for _ in range(2)]
    for k, grads in enumerate(micro):
        sums.add(0, "a", Tensor(grads["a"]))
        assert sums._device_sums.counts == ({} if k == 0 else {0: 1, 1: 1})   # queued
        sums.add(1, "b", Tensor(grads["b"]))
        assert sums._device_sums.counts == {0: k + 1, 1: k + 1}               # the last hook added both
    found = dict(sums.named_sums())
    for name in ("a", "b"):
        np.testing.assert_allclose(found[name].asnumpy(), micro[0][name] + micro[1][name], rtol=1e-6)
        assert found[name].shape == micro[0][name].shape


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


OPS = ("min", "max", "mean", "norm", "zeros", "nans")


def _numpy_row(array: np.ndarray, eps: float = 1e-8) -> list:
    flat = array.reshape(-1).astype(np.float64)
    if np.isnan(flat).any():
        return [np.nan, np.nan, np.nan, np.nan, float(np.mean(np.abs(flat) < eps)), float(np.isnan(flat).sum())]
    return [flat.min(), flat.max(), flat.mean(), np.sqrt(np.dot(flat, flat)), float(np.mean(np.abs(flat) < eps)), 0.0]


def _queued_sums(hooked: int, micro_batches: int, ops=OPS):
    from mindmon.features.tensor_stats.monitor import TensorStats

    sums = _sums(direct=True)
    stats = TensorStats(ops, 1e-8, on_host=True)
    sums.expect(hooked, micro_batches, stats)
    return sums, stats


def test_queued_gradients_are_added_when_every_hook_has_given_one_and_copied_before_the_caller_has_them(rng):
    """Hooks only queue; the queue is added when the micro-batch's last hooked gradient comes (the end of
    the backward pass, before the loop gets the gradients), so changing them afterwards changes no sum."""
    sums, _ = _queued_sums(hooked=2, micro_batches=2)
    grads = {name: _micro_batches(rng, (40, 30), np.float32, count=2) for name in ("a", "b")}
    tensors = {name: [Tensor(g.copy()) for g in micro] for name, micro in grads.items()}
    sums.add(0, "a", tensors["a"][0])
    assert sums._sums == {}                       # queued, nothing added yet
    sums.add(1, "b", tensors["b"][0])             # the micro-batch's last hook: both added
    assert sorted(sums._sums) == [0, 1]
    for name in grads:
        tensors[name][0].asnumpy()[...] = 1e6     # the loop accumulates into its gradients in place
    sums.add(0, "a", tensors["a"][1])
    sums.add(1, "b", tensors["b"][1])
    found = dict(sums.named_sums())
    for name, (first, second) in grads.items():
        assert np.array_equal(found[name].array, first + second), name


def test_a_second_gradient_of_one_parameter_flushes_a_micro_batch_some_hooks_missed(rng):
    sums, _ = _queued_sums(hooked=3, micro_batches=2)   # the third parameter never gets a gradient
    first, second = _micro_batches(rng, (17,), np.float32, count=2)
    other = _micro_batches(rng, (5, 5), np.float32, count=2)
    sums.add(0, "w", Tensor(first))
    sums.add(1, "v", Tensor(other[0]))
    sums.add(0, "w", Tensor(second))                   # a new micro-batch: the first is added now
    sums.add(1, "v", Tensor(other[1]))
    found = dict(sums.named_sums())                    # the optimizer call flushes the rest
    assert np.array_equal(found["w"].array, first + second)
    assert np.array_equal(found["v"].array, other[0] + other[1])


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_statistics_of_the_sums_taken_at_the_last_add_equal_numpy(rng, micro_batches, monkeypatch):
    from mindmon.features.tensor_stats import accumulate

    taken_later = []
    later = accumulate.host_statistics
    monkeypatch.setattr(accumulate, "host_statistics",
                        lambda tensors, *args: (taken_later.append(len(tensors)), later(tensors, *args))[1])
    shapes = {"big": (70, 90), "small": (33,), "scalar": (), "with_nan": (50, 100), "zeros": (4096 + 7,)}
    micro = {name: _micro_batches(rng, shape, np.float32, count=micro_batches) for name, shape in shapes.items()}
    micro["with_nan"][-1].reshape(-1)[123] = np.nan
    for array in micro["zeros"]:
        array.reshape(-1)[::3] = 0.0
    sums, stats = _queued_sums(hooked=len(shapes), micro_batches=micro_batches)
    for k in range(micro_batches):
        for index, name in enumerate(shapes):
            sums.add(index, name, Tensor(micro[name][k]))
    computed = sums.for_recording(stats)
    assert computed.names == list(shapes) and computed.ops == OPS
    assert taken_later == [1]                      # only the sum holding NaN is read again (numpy's rules)
    for name, row in zip(computed.names, computed.values):
        total = micro[name][0].copy()
        for array in micro[name][1:]:
            total = total + array                  # float32, in order, as the sums are made
        # float32 block sums: the mean is within float32 rounding of the sum of |x|, not of itself
        scale = float(np.nanmean(np.abs(total))) if total.size else 0.0
        np.testing.assert_allclose(row, _numpy_row(total), rtol=2e-6, atol=2e-6 * scale, err_msg=name)
    assert [tuple(map(int, shape)) for shape, _ in computed.layouts] == list(shapes.values())


def test_statistics_are_taken_again_when_the_sum_changed_after_its_last_add_or_the_ops_did(rng):
    sums, stats = _queued_sums(hooked=1, micro_batches=2)
    grads = _micro_batches(rng, (64, 64), np.float32, count=3)
    for grad in grads:                              # three micro-batches where two were expected
        sums.add(0, "w", Tensor(grad))
    np.testing.assert_allclose(sums.for_recording(stats).values[0], _numpy_row(grads[0] + grads[1] + grads[2]),
                               rtol=2e-6)
    stats.ops = ("norm", "max")                     # msprobe lets ops change while training
    np.testing.assert_allclose(sums.for_recording(stats).values[0],
                               np.array(_numpy_row(grads[0] + grads[1] + grads[2]))[[3, 1]], rtol=2e-6)


def _numpy_sums(micro_batches):
    total = {}
    for grads in micro_batches:
        for index, grad in grads.items():
            total[index] = grad.asnumpy().copy() if index not in total else total[index] + grad.asnumpy()
    return total


def _gradients(rng, shapes, count):
    return [{index: Tensor(rng.normal(size=shape).astype(np.float32)) for index, shape in enumerate(shapes)}
            for _ in range(count)]


def test_the_closer_is_learned_and_appends_sum_the_same(rng):
    """The first micro-batch goes through Python hooks (`add`), in a backward pass's order (2, 1, 0): the
    last parameter to give its gradient becomes the closer. Then the others are `append`s and the closer's
    `close` adds them: the sums are numpy's, and the statistics of the finished sums are taken in that add."""
    shapes = [(40, 3), (7,), (5, 5)]
    micro = _gradients(rng, shapes, 3)
    sums = _sums(direct=True)
    stats = type("Stats", (), {"ops": ("min", "norm"), "eps": 1e-8})()
    sums.expect(len(shapes), len(micro), stats)
    for index in (2, 1, 0):
        sums.add(index, f"p{index}", micro[0][index])
    assert sums.closer == 0
    hooks = {index: sums.append_hook(index, f"p{index}") for index in (1, 2)}
    assert all(type(hook).__name__ == "builtin_function_or_method" for hook in hooks.values())
    for grads in micro[1:]:
        hooks[2](grads[2])
        hooks[1](grads[1])
        sums.close(0, grads[0])
    assert sums.closer == 0   # the same order: still the closer
    recorded = sums.for_recording(stats)
    expected = _numpy_sums(micro)
    found = dict(sums.named_sums())
    for index in range(3):
        np.testing.assert_array_equal(found[f"p{index}"].array, expected[index])
        row = recorded.values[recorded.names.index(f"p{index}")]
        np.testing.assert_allclose(row, [expected[index].min(), np.linalg.norm(expected[index].astype(np.float64))],
                                   rtol=1e-6)
    assert sums._finished.keys() == {0, 1, 2}   # taken in the add, not read again


def test_a_gradient_after_the_closer_is_still_summed_and_the_order_learned_again(rng):
    """A backward pass that gives parameter 1's gradient after the closer's: it waits in its list and goes
    into the sum with the next micro-batch's (first of its list first, in a round of its own), and the closer
    is forgotten, so the next attachment learns the order again."""
    shapes = [(6, 4), (9,), (3,)]
    micro = _gradients(rng, shapes, 3)
    sums = _sums(direct=True)
    sums.expect(len(shapes), len(micro), None)
    for index in (2, 1, 0):
        sums.add(index, f"p{index}", micro[0][index])
    assert sums.closer == 0
    append = {index: sums.append_hook(index, f"p{index}") for index in (1, 2)}
    append[2](micro[1][2])
    sums.close(0, micro[1][0])   # parameter 1 has not come yet
    assert sums.closer is None
    append[1](micro[1][1])
    append[2](micro[2][2])
    append[1](micro[2][1])       # two gradients of parameter 1 wait
    sums.close(0, micro[2][0])
    found, expected = dict(sums.named_sums()), _numpy_sums(micro)
    for index in range(3):
        np.testing.assert_array_equal(found[f"p{index}"].array, expected[index])


def test_a_parameter_without_gradients_does_not_stop_learning(rng):
    """One hooked parameter never gets a gradient: the micro-batch ends at the next one's first gradient."""
    micro = _gradients(rng, [(4,), (5,)], 2)
    sums = _sums(direct=True)
    sums.expect(3, 2, None)   # three hooked, parameter 2 never gives one
    for grads in micro:
        sums.add(1, "p1", grads[1])
        sums.add(0, "p0", grads[0])
    assert sums.closer == 0 and sums._filled == 2
    found, expected = dict(sums.named_sums()), _numpy_sums(micro)
    for index in range(2):
        np.testing.assert_array_equal(found[f"p{index}"].array, expected[index])


def test_micro_batches_after_the_first_go_by_its_plan_and_leave_it_where_it_does_not_fit(rng, monkeypatch):
    """After a micro-batch whose every gradient was added at its address, the next ones go by its plan (no
    per-gradient Python). A micro-batch that does not fit it (a float16 gradient, one not contiguous, another
    shape: refused) is added one gradient at a time. Over two steps, every sum is numpy's."""
    from mindmon.features.tensor_stats import accumulate

    planned = []
    add_planned = accumulate.GradientSums._add_planned
    monkeypatch.setattr(accumulate.GradientSums, "_add_planned",
                        lambda self, lists: (planned.append(add_planned(self, lists)), planned[-1])[1])
    shapes = [(40, 3), (7,), (5, 6)]
    sums = _sums(direct=True)
    sums.expect(len(shapes), 4, None)
    for step in range(2):
        micro = _gradients(rng, shapes, 4)
        micro[2][1] = Tensor(micro[2][1].asnumpy().astype(np.float16))            # not float32
        micro[3][2] = Tensor(np.ascontiguousarray(micro[3][2].asnumpy().T)).transpose(1, 0)   # a strided view
        planned.clear()
        for grads in micro:
            for index in (2, 1, 0):
                sums.add(index, f"p{index}", grads[index])
        found = dict(sums.named_sums())
        # step 0 learns the plan from its first micro-batch; step 1 uses it from its first
        assert planned == ([False, True, False, False] if step == 0 else [True, True, False, False])
        for index, shape in enumerate(shapes):
            expected = micro[0][index].asnumpy().astype(np.float64)
            for grads in micro[1:]:
                expected = expected + grads[index].asnumpy().astype(np.float64)
            assert found[f"p{index}"].array.shape == shape
            np.testing.assert_allclose(found[f"p{index}"].array, expected, rtol=1e-5, atol=1e-5)
        sums.clear()
    for index, shape in enumerate(shapes[::-1]):   # a micro-batch by the plan, then one of another shape
        sums.add(2 - index, f"p{2 - index}", Tensor(rng.normal(size=shape).astype(np.float32)))
    with pytest.raises(ValueError, match="a gradient of 6 elements"):
        for index, shape in ((2, (5, 6)), (1, (7,)), (0, (2, 3))):
            sums.add(index, f"p{index}", Tensor(rng.normal(size=shape).astype(np.float32)))
