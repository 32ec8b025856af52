"""The train step's data-parallel arithmetic, in one process: the data-parallel mean of the gradients
and of the loss, the norm and clipping of that mean, the monitors' cross-rank sums packed into the
same collective and handed back in order.

The collective is played by `OtherRankGaveZeros`, a `DataParallel` of two ranks whose other rank
contributed zeros (its gradients, its loss, its monitors' tensors): the sum over the ranks is this
rank's tensor, the mean half of it. That makes every value predictable from the float64 replay of
one rank, and different from what one rank would write (the two-rank msrun test runs the real
all-reduce). Values are checked against the replay in tests/features/train_state/test_train_state_values.py.
"""
import numpy as np
import pytest
from mindspore import Tensor, nn

from tests.support.jsonl import read_jsonl
from mindmon.core.events import (GradientsReduced, MicroBatchEnd, MicroBatchGradients, MicroBatchLoss, ReduceBegin,
                            StepBegin, StepLoss, UpdateDone)
from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
from mindmon.parallel.data_parallel import DataParallel
from mindmon.core.engine import CrossRankPayload, CrossRankSizes, Monitor
from mindmon.core.group import MonitorGroup
from tests.features.train_state.test_train_state_values import (K, LR, NAMES, TwoLayer, _batches, _initial_weights, _loss_and_grads,
                                     assert_records_match, expected_records, replay)

pytestmark = pytest.mark.ms27   # needs neither MindFormers nor MindSpore 2.9

EVERYTHING = {"local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True}
PROBE_VALUES = (np.array([1.0, 2.0, 3.0], np.float32), np.array([[-4.0, 0.5]], np.float32))


class OtherRankGaveZeros(DataParallel):
    """Two ranks; the other one's tensors are all zero, so each sum is this rank's tensor."""

    def __init__(self):
        super().__init__()
        self.size, self.rank = 2, 0
        self.payload_lengths = []

    def sum(self, tensors):
        self.payload_lengths.append(len(tensors))
        return [t.copy() for t in tensors]

    def max(self, values):
        return np.maximum(values, 0.0)


class CrossRankProbe(Monitor):
    """Asks for two tensors to be summed over the ranks; keeps what comes back."""

    def __init__(self):
        self.received = []

    def cross_rank_sizes(self, num_micro_steps):
        return CrossRankSizes(data_parallel=sum(v.size for v in PROBE_VALUES))

    def cross_rank(self, num_micro_steps):
        return CrossRankPayload(data_parallel=Tensor(np.concatenate([v.reshape(-1) for v in PROBE_VALUES])))

    def receive_cross_rank(self, summed):
        self.received.append(np.split(summed.data_parallel, np.cumsum([v.size for v in PROBE_VALUES])[:-1]))

    def collect(self, step):
        return []


def one_two_rank_step(tmp_path, max_norm, on_host):
    """One step on rank 0 of two; returns (records, mean loss, grad norm, net, probe, data_parallel)."""
    data_parallel, probe = OtherRankGaveZeros(), CrossRankProbe()
    net = TwoLayer(_initial_weights())
    optimizer = nn.SGD(net.params, learning_rate=LR)
    config = parse_sections({"monitor": {"output_dir": str(tmp_path), "train_state": EVERYTHING}})
    built = build_group(config, parameter_names=list(NAMES), on_host=on_host, data_parallel=data_parallel)
    group = MonitorGroup(built.monitors + [probe], built.sinks, rank=0)
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=K, group=group, max_norm=max_norm,
                                       on_host=on_host, data_parallel=data_parallel)
    group.setup(max_steps=1)
    x, y = _batches()
    loss, grad_norm = train_step(split_batch((Tensor(x[0]), Tensor(y[0])), K))
    group.flush(1)
    group.close()
    records = {(r["kind"], r["step"], r["micro_step"], r["name"]): r["value"]
               for r in read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")}
    return records, float(loss.asnumpy()), grad_norm, net, probe, data_parallel


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("clipped", [False, True], ids=["below_max_norm", "above_max_norm"])
def test_two_ranks_apply_write_and_return_the_data_parallel_mean(tmp_path, on_host, clipped):
    one_rank = replay(max_norm=0.0)[1]
    accumulated = {n: (_initial_weights()[n] - one_rank["weights"][n]) / LR for n in NAMES}   # this rank's
    mean_norm = one_rank["grad_norm"] / 2.0
    max_norm = mean_norm * (0.5 if clipped else 1.5)
    records, loss, grad_norm, net, probe, data_parallel = one_two_rank_step(tmp_path, max_norm, on_host)

    # local values are this rank's; device values and the returned ones are the mean over both ranks
    mean = dict(one_rank, device_loss=one_rank["device_loss"] / 2.0,
                device_norm={n: one_rank["device_norm"][n] / 2.0 for n in NAMES})
    assert_records_match(records, expected_records(EVERYTHING, {1: mean}))
    assert loss == pytest.approx(one_rank["device_loss"] / 2.0, rel=1e-5)
    assert grad_norm == pytest.approx(mean_norm, rel=1e-5)
    scale = 0.5 if clipped else 1.0
    for param in net.params:
        expected = _initial_weights()[param.name] - LR * scale * accumulated[param.name] / 2.0
        np.testing.assert_allclose(param.asnumpy(), expected, rtol=1e-5, atol=1e-6)
    # one collective: 4 gradients, the loss, the monitors' payloads in one flat tensor; the probe gets its own back
    assert data_parallel.payload_lengths == [len(NAMES) + 1 + 1]
    assert len(probe.received) == 1
    for got, sent in zip(probe.received[0], PROBE_VALUES, strict=True):
        np.testing.assert_array_equal(got, sent.reshape(-1))


def test_two_ranks_without_monitoring_reduce_only_the_gradients_and_the_loss():
    """No group: the collective carries the 4 gradients and the loss, nothing else."""
    one_rank = replay(max_norm=0.0)[1]
    data_parallel = OtherRankGaveZeros()
    net = TwoLayer(_initial_weights())
    train_step = AccumulatingTrainStep(net, nn.SGD(net.params, learning_rate=LR), num_micro_steps=K,
                                       max_norm=0.0, data_parallel=data_parallel)
    x, y = _batches()
    loss, grad_norm = train_step(split_batch((Tensor(x[0]), Tensor(y[0])), K))
    assert data_parallel.payload_lengths == [len(NAMES) + 1]
    assert float(loss.asnumpy()) == pytest.approx(one_rank["device_loss"] / 2.0, rel=1e-5)
    assert grad_norm == pytest.approx(one_rank["grad_norm"] / 2.0, rel=1e-5)
    for param in net.params:   # half of this rank's step: the other rank's gradient is zero
        start = _initial_weights()[param.name]
        np.testing.assert_allclose(param.asnumpy(), (start + one_rank["weights"][param.name]) / 2.0,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_split_batch_cuts_every_column_into_equal_consecutive_pieces(as_dict):
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    y = np.arange(6, dtype=np.int32) * 10
    batch = {"x": Tensor(x), "y": Tensor(y)} if as_dict else (Tensor(x), Tensor(y))
    for num_micro_steps in (2, 3):
        pieces, size = split_batch(batch, num_micro_steps), 6 // num_micro_steps
        assert len(pieces) == num_micro_steps
        for k, piece in enumerate(pieces):
            columns = (piece["x"], piece["y"]) if as_dict else piece
            assert isinstance(piece, dict if as_dict else tuple)
            np.testing.assert_array_equal(columns[0].asnumpy(), x[k * size:(k + 1) * size])
            np.testing.assert_array_equal(columns[1].asnumpy(), y[k * size:(k + 1) * size])
    whole = split_batch(batch, 1)
    assert len(whole) == 1
    np.testing.assert_array_equal((whole[0]["x"] if as_dict else whole[0][0]).asnumpy(), x)


@pytest.mark.parametrize("leading_sizes, num_micro_steps", [((6, 4), 2), ((6, 6), 4)],
                         ids=["sizes_differ", "not_divisible"])
def test_split_batch_refuses_what_it_cannot_cut_evenly(leading_sizes, num_micro_steps):
    batch = tuple(Tensor(np.zeros((n, 2), np.float32)) for n in leading_sizes)
    with pytest.raises(ValueError) as error:
        split_batch(batch, num_micro_steps)
    assert str(error.value) == (
        f"cannot cut a batch with leading sizes {sorted(set(leading_sizes))} into {num_micro_steps} equal "
        f"micro-batches; the dataset must yield global_batch_size / data_parallel samples per step")


class _ParametersMethod:
    """torch.optim style: `parameters` would be a method, not the sequence the step differentiates by."""

    def parameters(self):
        return []

    def __call__(self, gradients):
        pass


class _NotCallable:
    """Has the parameters but cannot be applied with `optimizer(gradients)`."""

    def __init__(self, parameters):
        self.parameters = parameters


@pytest.mark.parametrize("make_optimizer", [lambda params: _ParametersMethod(), lambda params: _NotCallable(params)],
                         ids=["parameters_is_a_method", "not_callable"])
def test_an_optimizer_the_step_cannot_use_is_refused_with_the_whole_message(make_optimizer):
    net = TwoLayer(_initial_weights())
    optimizer = make_optimizer(net.params)
    with pytest.raises(TypeError) as error:
        AccumulatingTrainStep(net, optimizer, num_micro_steps=2)
    kind = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    assert str(error.value) == (
        f"optimizer: got {kind}, which has no `.parameters` sequence or cannot be called with the gradients; "
        f"allowed: a MindSpore optimizer (mindspore.nn.Optimizer, e.g. nn.AdamWeightDecay(net.trainable_params())); "
        f"torch-style optimizers (param_groups, step()) are not supported")


def test_num_micro_steps_below_one_is_refused_and_one_is_a_plain_step():
    net = TwoLayer(_initial_weights())
    optimizer = nn.SGD(net.params, learning_rate=LR)
    with pytest.raises(ValueError) as error:
        AccumulatingTrainStep(net, optimizer, num_micro_steps=0)
    assert str(error.value) == "num_micro_steps: got 0; allowed: a positive int"
    x, y = _batches()
    loss, grad_norm = AccumulatingTrainStep(net, optimizer, num_micro_steps=1, max_norm=0.0)(
        split_batch((Tensor(x[0]), Tensor(y[0])), 1))
    expected_loss, grads = _loss_and_grads({n: w.astype(np.float64) for n, w in _initial_weights().items()},
                                           x[0], y[0])
    assert float(loss.asnumpy()) == pytest.approx(expected_loss, rel=1e-5)
    assert grad_norm == pytest.approx(np.sqrt(sum(np.sum(g ** 2) for g in grads.values())), rel=1e-5)


class KeyLog(Monitor):
    """Logs every step event the step emits, with its micro_step, in order (the MoE token monitor relies on
    the step-begin and micro-batch-end events)."""

    EVENTS = (StepBegin, MicroBatchLoss, MicroBatchGradients, MicroBatchEnd, ReduceBegin, GradientsReduced,
              UpdateDone, StepLoss)

    def __init__(self):
        self.keys = []

    def reset(self):
        self.keys.append(("reset", None))

    def on_event(self, event):
        self.keys.append((type(event).__name__, getattr(event, "micro_step", None)))

    def collect(self, step):
        return []


def test_the_step_emits_its_events_in_order_to_an_active_group():
    log = KeyLog()
    net = TwoLayer(_initial_weights())
    train_step = AccumulatingTrainStep(net, nn.SGD(net.params, learning_rate=LR), num_micro_steps=2,
                                       group=MonitorGroup([log]))
    x, y = _batches()
    train_step(split_batch((Tensor(x[0]), Tensor(y[0])), 2))
    per_micro_step = [[("MicroBatchLoss", k), ("MicroBatchGradients", k), ("MicroBatchEnd", k)] for k in range(2)]
    assert log.keys == ([("reset", None), ("StepBegin", None)] + per_micro_step[0] + per_micro_step[1]
                        + [("ReduceBegin", None), ("GradientsReduced", None), ("UpdateDone", None),
                           ("StepLoss", None)])


class SkipEveryUpdate:
    """An action that asks to skip every update, logging the norms it was asked about."""

    def __init__(self):
        self.asked = []

    def should_skip_update(self, grad_norm):
        self.asked.append(grad_norm)
        return True


def test_an_update_an_action_skips_leaves_the_parameters_and_is_asked_with_the_norm():
    actions = SkipEveryUpdate()
    net = TwoLayer(_initial_weights())
    train_step = AccumulatingTrainStep(net, nn.SGD(net.params, learning_rate=LR), num_micro_steps=K,
                                       group=MonitorGroup([KeyLog()], actions=actions), max_norm=0.0)
    x, y = _batches()
    _, grad_norm = train_step(split_batch((Tensor(x[0]), Tensor(y[0])), K))
    assert actions.asked == [grad_norm]
    assert grad_norm == pytest.approx(replay(max_norm=0.0)[1]["grad_norm"], rel=1e-5)
    for param in net.params:
        np.testing.assert_array_equal(param.asnumpy(), _initial_weights()[param.name])


class SnapshotLog(Monitor):
    """Copies what each micro-step's gradient snapshot holds when it is recorded (the host buffer's
    views change with the next micro-step)."""

    EVENTS = (MicroBatchGradients,)

    def __init__(self):
        self.micro, self.accumulated, self.kinds = [], [], set()

    def on_event(self, event):
        value = event.gradients
        self.kinds |= {type(t) for t in list(value.micro) + list(value.accumulated)}
        def copied(tensors):
            return [np.array(t if isinstance(t, np.ndarray) else t.asnumpy(), np.float64).reshape(-1)
                    for t in tensors]
        self.micro.append(copied(value.micro))
        self.accumulated.append(copied(value.accumulated))

    def collect(self, step):
        return []


@pytest.mark.parametrize("on_host", [True, False, None], ids=["host", "device", "default"])
def test_each_snapshot_holds_the_micro_batch_gradient_and_the_running_sum(on_host):
    """The snapshot's contract for every monitor that reads it: grad(loss_k / K) and its sum up to k,
    as views of the numpy host buffer on the host path (the default on CPU), else as MindSpore tensors."""
    log = SnapshotLog()
    net = TwoLayer(_initial_weights())
    train_step = AccumulatingTrainStep(net, nn.SGD(net.params, learning_rate=LR), num_micro_steps=K,
                                       group=MonitorGroup([log]), on_host=on_host)
    x, y = _batches()
    train_step(split_batch((Tensor(x[0]), Tensor(y[0])), K))
    assert log.kinds == ({Tensor} if on_host is False else {np.ndarray})
    weights = {n: w.astype(np.float64) for n, w in _initial_weights().items()}
    size, running = x.shape[1] // K, {n: 0.0 for n in NAMES}
    assert len(log.micro) == len(log.accumulated) == K
    for k in range(K):
        _, grads = _loss_and_grads(weights, x[0, k * size:(k + 1) * size], y[0, k * size:(k + 1) * size])
        for i, name in enumerate(NAMES):
            running[name] = running[name] + grads[name] / K
            np.testing.assert_allclose(log.micro[k][i], (grads[name] / K).reshape(-1), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(log.accumulated[k][i], running[name].reshape(-1), rtol=1e-5, atol=1e-6)


def test_the_default_max_norm_is_one():
    """A loss scaled by 100 has a global norm far above 1: the update is exactly LR * 1.0 long."""
    net = TwoLayer(_initial_weights())
    train_step = AccumulatingTrainStep(lambda x, y: net(x, y) * 100.0, nn.SGD(net.params, learning_rate=LR),
                                       num_micro_steps=K)
    x, y = _batches()
    _, grad_norm = train_step(split_batch((Tensor(x[0]), Tensor(y[0])), K))
    assert grad_norm == pytest.approx(100.0 * replay(max_norm=0.0)[1]["grad_norm"], rel=1e-5)
    assert grad_norm > 10.0
    moved = [param.asnumpy().astype(np.float64) - _initial_weights()[param.name] for param in net.params]
    assert np.sqrt(sum(np.sum(m ** 2) for m in moved)) == pytest.approx(LR * 1.0, rel=1e-5)


def test_a_max_norm_that_is_not_a_finite_non_negative_number_is_refused_by_its_argument_name():
    from mindmon.config import ConfigError

    net = TwoLayer(_initial_weights())
    with pytest.raises(ConfigError) as error:
        AccumulatingTrainStep(net, nn.SGD(net.params, learning_rate=LR), num_micro_steps=K, max_norm=float("nan"))
    assert str(error.value) == ("max_norm: got nan (float); allowed: a finite number > 0 (clip the global "
                                "gradient norm to it) or 0 (no clipping)")
