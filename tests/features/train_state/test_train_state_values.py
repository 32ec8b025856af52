"""Every `train_state` switch alone and in the combinations that change what is computed, in a plain
loop, with every value compared to a float64 numpy replay of the same model: forward, backward by
hand, accumulation of grad(loss_k / K), clipping by global norm, SGD.

The records written are compared as a whole: the set of (kind, step, micro_step, name) must be
exactly the one the switches ask for, and every value must match the replay.
"""
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

from tests.support.jsonl import read_jsonl
from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch

pytestmark = pytest.mark.ms27   # also runs on MindSpore 2.7 (make test-ms27)

K, SAMPLES, STEPS, LR = 4, 8, 2, 0.5
NAMES = ("hidden.weight", "hidden.bias", "out.weight", "out.bias")


def _initial_weights():
    rng = np.random.default_rng(11)
    shapes = {"hidden.weight": (3, 4), "hidden.bias": (4,), "out.weight": (4, 1), "out.bias": (1,)}
    return {name: rng.normal(0.0, 0.8, size=shapes[name]).astype(np.float32) for name in NAMES}


def _batches():
    rng = np.random.default_rng(12)
    x = rng.normal(size=(STEPS, SAMPLES, 3)).astype(np.float32)
    y = (np.sin(x @ np.array([[1.0], [-2.0], [0.5]])) + 0.3).astype(np.float32)
    return x, y


class TwoLayer(nn.Cell):
    """tanh(x W1 + b1) W2 + b2, mean squared error."""

    def __init__(self, weights):
        super().__init__()
        self.params = [Parameter(Tensor(weights[name]), name=name) for name in NAMES]
        self.w1, self.b1, self.w2, self.b2 = self.params

    def construct(self, x, y):
        hidden = ops.tanh(ops.matmul(x, self.w1) + self.b1)
        diff = ops.matmul(hidden, self.w2) + self.b2 - y
        return (diff * diff).mean()


def _loss_and_grads(w, x, y):
    """The loss of one micro-batch and its gradient, by hand in float64."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    hidden = np.tanh(x @ w["hidden.weight"] + w["hidden.bias"])
    diff = hidden @ w["out.weight"] + w["out.bias"] - y
    d_out = 2.0 * diff / diff.size
    d_pre = (d_out @ w["out.weight"].T) * (1.0 - hidden ** 2)
    grads = {"hidden.weight": x.T @ d_pre, "hidden.bias": d_pre.sum(axis=0),
             "out.weight": hidden.T @ d_out, "out.bias": d_out.sum(axis=0)}
    return float(np.mean(diff ** 2)), grads


def replay(max_norm):
    """Per step: every value train_state can record, the global norm, and the weights after the update.
    {step: {"local_loss": [K], "local_norm": {name: [K]}, "micro_norm": {name: [K]}, "device_norm":
    {name}, "device_loss", "grad_norm", "weights"}}."""
    w = {name: v.astype(np.float64) for name, v in _initial_weights().items()}
    x, y = _batches()
    size, steps = SAMPLES // K, {}
    for step in range(1, STEPS + 1):
        accumulated = {name: np.zeros_like(w[name]) for name in NAMES}
        out = {"local_loss": [], "local_norm": {n: [] for n in NAMES}, "micro_norm": {n: [] for n in NAMES}}
        previous = {name: 0.0 for name in NAMES}
        for k in range(K):
            rows = slice(k * size, (k + 1) * size)
            loss, grads = _loss_and_grads(w, x[step - 1, rows], y[step - 1, rows])
            out["local_loss"].append(loss)
            for name in NAMES:
                micro = grads[name] / K
                accumulated[name] += micro
                norm = np.linalg.norm(accumulated[name])
                out["local_norm"][name].append(norm - previous[name])
                out["micro_norm"][name].append(np.linalg.norm(micro))
                previous[name] = norm
        out["device_norm"] = previous
        out["device_loss"] = float(np.mean(out["local_loss"]))
        grad_norm = float(np.sqrt(sum(np.sum(g ** 2) for g in accumulated.values())))
        scale = max_norm / grad_norm if 0 < max_norm < grad_norm else 1.0
        w = {name: w[name] - LR * scale * accumulated[name] for name in NAMES}
        out.update(grad_norm=grad_norm, weights=w, clipped=scale != 1.0)
        steps[step] = out
    return steps


def expected_records(train_state, steps):
    """{(kind, step, micro_step, name): value} of exactly what the switches ask for."""
    def selected(switch):
        value = train_state.get(switch, False)
        if value is True:
            return list(NAMES)
        substrings = [value] if isinstance(value, str) else list(value or [])
        return [n for n in NAMES if any(s in n for s in substrings)]

    expected = {}
    for step, out in steps.items():
        for k in range(K):
            if train_state.get("local_loss"):
                expected[("local_loss", step, k, "loss")] = out["local_loss"][k]
            for name in selected("local_norm"):
                expected[("local_norm", step, k, name)] = out["local_norm"][name][k]
                expected[("micro_norm", step, k, name)] = out["micro_norm"][name][k]
        for name in selected("device_norm"):
            expected[("device_norm", step, None, name)] = out["device_norm"][name]
        if train_state.get("device_loss"):
            expected[("device_loss", step, None, "loss")] = out["device_loss"]
    return expected


def run_loop(tmp_path, train_state, max_norm=0.0, on_host=None):
    """Trains STEPS steps of K micro-steps; returns the records written, the grad norms and the net."""
    net = TwoLayer(_initial_weights())
    optimizer = nn.SGD(net.params, learning_rate=LR)
    config = parse_sections({"monitor": {"output_dir": str(tmp_path), "train_state": train_state}})
    group = build_group(config, parameter_names=[p.name for p in optimizer.parameters], on_host=on_host)
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=K, group=group, max_norm=max_norm,
                                       on_host=on_host)
    group.setup(max_steps=STEPS)
    x, y = _batches()
    grad_norms = []
    for step in range(1, STEPS + 1):
        _, grad_norm = train_step(split_batch((Tensor(x[step - 1]), Tensor(y[step - 1])), K))
        grad_norms.append(grad_norm)
        group.flush(step)
    group.close()
    records = {(r["kind"], r["step"], r["micro_step"], r["name"]): r["value"]
               for r in read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")}
    return records, grad_norms, net


def assert_records_match(records, expected):
    assert sorted(records, key=str) == sorted(expected, key=str)
    for key, value in expected.items():
        # float32 forward/backward against float64: 1e-5 relative; a local_norm is a difference of two
        # norms of about 0.1-1, so its float32 rounding is absolute, about 1e-7
        assert records[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


SWITCHES = {
    "local_norm": {"local_norm": True},
    "local_loss": {"local_loss": True},
    "device_norm": {"device_norm": True},
    "device_loss": {"device_loss": True},
    "device_norm_filtered_without_local_norm": {"device_norm": "out"},
    "local_norm_filtered_with_device_norm_all": {"local_norm": "hidden", "device_norm": True},
    "local_norm_list_with_device_norm_filtered": {"local_norm": ["out.weight", "hidden.bias"],
                                                  "device_norm": "weight", "device_loss": True},
    "local_norm_without_device_norm": {"local_norm": "bias", "local_loss": True},
    "everything": {"local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True},
}


@pytest.mark.parametrize("train_state", list(SWITCHES.values()), ids=list(SWITCHES))
def test_switches_write_exactly_the_replayed_values(tmp_path, train_state):
    records, _, _ = run_loop(tmp_path, train_state)
    assert_records_match(records, expected_records(train_state, replay(max_norm=0.0)))


def test_device_path_writes_the_same_values(tmp_path):
    """`on_host=False`: norms taken by MindSpore ops and stacked, read at flush."""
    train_state = {"local_norm": "weight", "local_loss": True, "device_norm": "bias", "device_loss": True}
    records, grad_norms, _ = run_loop(tmp_path, train_state, max_norm=0.0, on_host=False)
    steps = replay(max_norm=0.0)
    assert_records_match(records, expected_records(train_state, steps))
    assert grad_norms == pytest.approx([steps[s]["grad_norm"] for s in steps], rel=1e-5)


def test_local_norms_add_up_to_the_device_norm(tmp_path):
    records, _, _ = run_loop(tmp_path, {"local_norm": True, "device_norm": True})
    for step in range(1, STEPS + 1):
        for name in NAMES:
            increments = [records[("local_norm", step, k, name)] for k in range(K)]
            assert sum(increments) == pytest.approx(records[("device_norm", step, None, name)], rel=1e-5)


@pytest.mark.parametrize("side", ["below", "above"])
def test_clipping_on_both_sides_of_max_norm(tmp_path, side):
    """Below max_norm the parameters move by the whole update; above, by max_norm / norm of it.
    device_norm and grad_norm are the norms before clipping either way."""
    unclipped = replay(max_norm=0.0)
    first_norm = unclipped[1]["grad_norm"]
    max_norm = first_norm * (1.5 if side == "below" else 0.5)
    steps = replay(max_norm)
    assert steps[1]["clipped"] == (side == "above")
    train_state = {"device_norm": True, "device_loss": True}
    records, grad_norms, net = run_loop(tmp_path, train_state, max_norm=max_norm)
    assert_records_match(records, expected_records(train_state, steps))
    assert grad_norms == pytest.approx([steps[s]["grad_norm"] for s in steps], rel=1e-5)
    for param in net.params:
        np.testing.assert_allclose(param.asnumpy(), steps[STEPS]["weights"][param.name], rtol=1e-5, atol=1e-6)
    if side == "above":  # the first update is exactly max_norm long
        moved = [steps[1]["weights"][n] - _initial_weights()[n] for n in NAMES]
        assert np.sqrt(sum(np.sum(m ** 2) for m in moved)) == pytest.approx(LR * max_norm, rel=1e-9)


@pytest.mark.parametrize("switch", ["local_norm", "device_norm"])
def test_a_filter_that_matches_nothing_is_refused_before_step_1(tmp_path, switch):
    from mindmon.config import ConfigError

    config = parse_sections({"monitor": {"output_dir": str(tmp_path),
                                         "train_state": {switch: ["out", "atention"]}}})
    with pytest.raises(ConfigError) as error:
        build_group(config, parameter_names=list(NAMES) + ["final_norm.weight"])  # only 4 are named
    assert str(error.value) == (f"monitor.train_state.{switch}: 'atention' matches no trainable parameter; allowed: "
                                f"substrings of parameter names such as hidden.weight, hidden.bias, out.weight, out.bias")


def test_monitor_alone_writes_only_what_was_recorded_and_forgets_it_at_collect():
    """The monitor outside the loop: a step with no device loss or device gradient recorded writes
    neither; after collect nothing of the step is left for the next one."""
    from mindmon.features.train_state.config import TrainStateConfig
    from mindmon.core.events import GradientSnapshot, GradientsReduced, MicroBatchGradients, MicroBatchLoss
    from mindmon.features.train_state.monitor import TrainStateMonitor

    config = TrainStateConfig.parse("monitor.train_state", {"local_norm": True, "local_loss": True,
                                                            "device_norm": True, "device_loss": True})
    monitor = TrainStateMonitor(config, ["w"], rank=3, on_host=True)
    g0, g1 = Tensor(np.array([3.0, 4.0], np.float32)), Tensor(np.array([0.0, 8.0], np.float32))
    monitor.on_event(MicroBatchLoss(0, Tensor(np.float32(2.5))))
    monitor.on_event(MicroBatchGradients(0, GradientSnapshot([g0], [g0])))
    monitor.on_event(MicroBatchGradients(1, GradientSnapshot([g1], [g0 + g1])))
    monitor.on_event(GradientsReduced(None))   # one rank: device_norm is the last accumulated norm
    collected = monitor.collect(step=7)
    assert {(r.step, r.rank, r.iteration) for r in collected} == {(7, 3, None)}
    records = {(r.kind, r.micro_step, r.name): r.value for r in collected}
    assert records == {("local_loss", 0, "loss"): 2.5,
                       ("local_norm", 0, "w"): 5.0, ("micro_norm", 0, "w"): 5.0,
                       ("local_norm", 1, "w"): pytest.approx(np.hypot(3.0, 12.0) - 5.0, rel=1e-12),
                       ("micro_norm", 1, "w"): 8.0,
                       ("device_norm", None, "w"): pytest.approx(np.hypot(3.0, 12.0), rel=1e-12)}
    assert monitor.collect(step=8) == []


def test_device_norm_of_the_reduced_gradient_when_one_is_given():
    """With several ranks the loop hands the data-parallel mean to `device_norm`: its norm is written,
    not this rank's accumulated one; local norms stay this rank's own. Filters pick the names."""
    from mindmon.features.train_state.config import TrainStateConfig
    from mindmon.core.events import GradientSnapshot, GradientsReduced, MicroBatchGradients
    from mindmon.features.train_state.monitor import TrainStateMonitor

    config = TrainStateConfig.parse("monitor.train_state", {"local_norm": "a", "device_norm": "b"})
    monitor = TrainStateMonitor(config, ["a", "skipped", "b"], on_host=False)   # rank 0 by default
    local = [Tensor(np.full(5000, v, np.float32)) for v in (1.0, 2.0, 3.0)]
    reduced = [Tensor(np.full(5000, v, np.float32)) for v in (0.5, 7.0, 0.25)]
    monitor.on_event(MicroBatchGradients(0, GradientSnapshot(local, local)))
    monitor.on_event(GradientsReduced(reduced))
    collected = monitor.collect(step=1)
    assert {r.rank for r in collected} == {0}
    records = {(r.kind, r.micro_step, r.name): r.value for r in collected}
    assert records == {("local_norm", 0, "a"): pytest.approx(np.sqrt(5000.0), rel=1e-6),
                       ("micro_norm", 0, "a"): pytest.approx(np.sqrt(5000.0), rel=1e-6),
                       ("device_norm", None, "b"): pytest.approx(0.25 * np.sqrt(5000.0), rel=1e-6)}


def test_a_given_way_of_taking_norms_is_the_one_used():
    """`norms=` swaps in another SquaredNorms (the overhead benchmark does): the monitor must use it."""
    from mindmon.features.train_state.config import TrainStateConfig
    from mindmon.core.events import GradientSnapshot, MicroBatchGradients
    from mindmon.features.train_state.monitor import TrainStateMonitor
    from mindmon.kernels.stats import SquaredNorms

    class QuadrupledNorms(SquaredNorms):
        def results(self):
            return {key: 4.0 * value for key, value in super().results().items()}

    config = TrainStateConfig.parse("monitor.train_state", {"device_norm": True})
    monitor = TrainStateMonitor(config, ["w"], norms=QuadrupledNorms(on_host=True))
    grad = Tensor(np.array([3.0, 4.0], np.float32))
    monitor.on_event(MicroBatchGradients(0, GradientSnapshot([grad], [grad])))
    assert [(r.kind, r.value) for r in monitor.collect(step=1)] == [("device_norm", 10.0)]
