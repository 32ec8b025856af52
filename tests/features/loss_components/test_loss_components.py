"""Per-component losses (mindmon/features/loss_components): the demo model's `lm loss`, `load_balancing_loss`
and `mtp_1 loss`, recomputed in float64 numpy from what forward hooks saw (the output layer's logits, each
router's scores), never from mindmon's or the model's own loss code."""
import logging

import numpy as np
import pytest

from tests.support.demo_trainer import SMALL_MODEL, make_model
from tests.support.jsonl import read_jsonl
from mindmon import build_group
from mindmon.config import ConfigError
from mindmon.features import parse_sections

K, STEPS, BATCH = 2, 2, 4
SEQ, VOCAB = SMALL_MODEL["seq_length"], SMALL_MODEL["vocab_size"]


def _cross_entropy(logits, labels):
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(labels)), labels].mean())


def _balance_loss(scores, config):
    """Switch-style: coeff x E x sum_e(fraction of routed slots to e x mean router probability of e)."""
    scores = scores.astype(np.float64)
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    top = np.argsort(-probs, axis=1, kind="stable")[:, :config.moe_router_topk]
    fraction = np.bincount(top.ravel(), minlength=config.num_experts) / top.size
    return config.aux_loss_coeff * config.num_experts * float((fraction * probs.mean(axis=0)).sum())


class ForwardLog:
    """Forward hooks: every call of the output layer (main head, then each MTP depth) and of each router,
    in the order of the forward."""

    def __init__(self, model):
        from mindmon.demo.model import Router

        self.calls = []
        model.output_layer.register_forward_hook(self._saver("output"))
        for name, cell in model.cells_and_names():
            if isinstance(cell, Router):
                cell.register_forward_hook(self._saver("mtp" if name.startswith("mtp.") else "decoder"))

    def _saver(self, where):
        def save(cell, inputs, output):
            self.calls.append((where, output.asnumpy().copy()))
        return save

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def expected_components(calls, labels, config):
    """One micro-batch's components from its forward's hooks (decoder routers, the main head, then per
    MTP depth its router and the head)."""
    outputs = [value for where, value in calls if where == "output"]
    weight = config.mtp_loss_scale / config.mtp_num_layers
    balance = sum(_balance_loss(v, config) for where, v in calls if where == "decoder")
    balance += weight * sum(_balance_loss(v, config) for where, v in calls if where == "mtp")
    parts = {"lm loss": _cross_entropy(outputs[0], labels.reshape(-1)), "load_balancing_loss": balance}
    for depth in range(1, config.mtp_num_layers + 1):
        parts[f"mtp_{depth} loss"] = weight * _cross_entropy(outputs[depth], labels[:, depth:].reshape(-1))
    return parts


def _batches():
    data = np.random.default_rng(5)
    return [(data.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32), data.integers(0, VOCAB, (BATCH, SEQ))
             .astype(np.int32)) for _ in range(STEPS)]


def _config(tmp_path, **section):
    return parse_sections({"monitor": {"output_dir": str(tmp_path / "out"),
                                       "loss_components": {"enabled": True, **section},
                                       "train_state": {"local_loss": True},
                                       "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}})


def _train_demo(tmp_path):
    """K micro-batches per step through AccumulatingTrainStep; returns the expected components per
    (step, micro_step) and the model's own micro-batch losses."""
    from mindspore import Tensor, nn

    from mindmon.demo.model import DemoModelConfig
    from mindmon.loop.step import AccumulatingTrainStep

    model = make_model()
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2)
    group = build_group(_config(tmp_path), model=model, parameter_names=[p.name for p in optimizer.parameters])
    log = ForwardLog(model)
    config = DemoModelConfig.from_dict(SMALL_MODEL)
    step_fn = AccumulatingTrainStep(lambda ids, labels: model(ids, labels)[0], optimizer, K, group)
    group.setup(max_steps=STEPS)
    expected = {}
    for step, (ids, labels) in enumerate(_batches(), start=1):
        size = BATCH // K
        micro = [(Tensor(ids[k * size:(k + 1) * size]), Tensor(labels[k * size:(k + 1) * size])) for k in range(K)]
        loss, grad_norm = step_fn(micro)
        calls = log.take()
        per_forward = len(calls) // K
        for k in range(K):
            expected[(step, k)] = expected_components(calls[k * per_forward:(k + 1) * per_forward],
                                                      labels[k * size:(k + 1) * size], config)
        group.flush(step, loss=loss, grad_norm=grad_norm)
    group.close()
    return expected


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("components")
    return tmp_path, _train_demo(tmp_path)


def test_micro_batch_components_equal_numpy(demo_run):
    tmp_path, expected = demo_run
    rows = [r for r in read_jsonl(tmp_path / "out" / "rank_0" / "metrics.jsonl") if r["kind"] == "loss_component"]
    got = {(r["step"], r["micro_step"], r["name"]): r["value"] for r in rows}
    assert len(got) == len(rows) == STEPS * K * 3
    for (step, k), parts in expected.items():
        assert set(parts) == {"lm loss", "load_balancing_loss", "mtp_1 loss"}
        for name, value in parts.items():
            assert got[(step, k, name)] == pytest.approx(value, rel=1e-5), (step, k, name)


def test_components_add_up_to_the_micro_batch_loss(demo_run):
    tmp_path, expected = demo_run
    rows = read_jsonl(tmp_path / "out" / "rank_0" / "metrics.jsonl")
    losses = {(r["step"], r["micro_step"]): r["value"] for r in rows if r["kind"] == "local_loss"}
    for key, parts in expected.items():
        assert losses[key] == pytest.approx(sum(parts.values()), rel=1e-5), key


def test_step_value_is_the_mean_over_micro_batches(demo_run):
    tmp_path, expected = demo_run
    rows = [r for r in read_jsonl(tmp_path / "out" / "rank_0" / "metrics.jsonl") if r["kind"] == "loss_component_step"]
    got = {(r["step"], r["name"]): r["value"] for r in rows}
    for step in range(1, STEPS + 1):
        for name in ("lm loss", "load_balancing_loss", "mtp_1 loss"):
            want = np.mean([expected[(step, k)][name] for k in range(K)])
            assert got[(step, name)] == pytest.approx(want, rel=1e-5)


def test_tensorboard_has_megatron_names(demo_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp_path, expected = demo_run
    events = EventAccumulator(str(tmp_path / "tb" / "rank_0"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm_loss", "load_balancing_loss", "mtp_1_loss", "loss"} <= tags
    lm = [e.value for e in events.Scalars("lm_loss")]   # the language-model part alone, as Megatron's
    assert lm == pytest.approx([np.mean([expected[(s, k)]["lm loss"] for k in range(K)])
                                for s in range(1, STEPS + 1)], rel=1e-5)
    total = [e.value for e in events.Scalars("loss")]   # the whole loss
    assert total == pytest.approx([np.mean([sum(expected[(s, k)].values()) for k in range(K)])
                                   for s in range(1, STEPS + 1)], rel=1e-5)


def test_a_plain_loop_hands_them_in_and_the_log_line_reads_back(tmp_path, caplog):
    from mindmon.analysis.parse_log import LogParser

    group = build_group(_config(tmp_path))
    group.setup()
    values = {1: [{"lm loss": 2.0, "z_loss": 0.5}, {"lm loss": 3.0, "z_loss": 0.25}], 2: [{"lm loss": 1.5}]}
    with caplog.at_level(logging.INFO, logger="mindmon"):
        for step, micro in values.items():
            for k, parts in enumerate(micro):
                group.record("loss_components", parts, {"micro_step": k})
            group.flush(step)
    group.close()
    lines = [line for r in caplog.records for line in r.getMessage().splitlines() if "loss_components" in line]
    assert lines == ['{ "step": 1, "loss_components": {"lm loss": 2.5, "z_loss": 0.375} }',
                     '{ "step": 2, "loss_components": {"lm loss": 1.5} }']
    parser = LogParser()
    records = [r for line in lines for r in parser.feed(line)]
    assert [(r.step, r.kind, r.name, r.value) for r in records] == [
        (1, "loss_component_step", "lm loss", 2.5), (1, "loss_component_step", "z_loss", 0.375),
        (2, "loss_component_step", "lm loss", 1.5)]


def test_a_model_without_the_protocol_is_said_once_and_training_goes_on(tmp_path, caplog):
    from mindspore import Tensor, nn, ops

    from mindmon.loop.step import AccumulatingTrainStep

    net = nn.Dense(3, 1)
    optimizer = nn.SGD(net.trainable_params(), 0.1)
    group = build_group(_config(tmp_path), model=net, parameter_names=[p.name for p in optimizer.parameters])
    step_fn = AccumulatingTrainStep(lambda x: ops.mean(net(x) ** 2), optimizer, 1, group)
    group.setup()
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        for step in (1, 2):
            loss, _ = step_fn([(Tensor(np.ones((2, 3), np.float32)),)])
            group.flush(step, loss=loss)
    errors = [r for r in caplog.records if "LossComponentsMonitor failed" in r.getMessage()]
    assert len(errors) == 1 and "has no get_loss_components()" in str(errors[0].exc_info[1])
    rows = read_jsonl(tmp_path / "out" / "rank_0" / "metrics.jsonl")
    assert sorted(r["step"] for r in rows if r["kind"] == "local_loss") == [1, 2]
    group.close()


def test_more_components_than_the_payload_holds_is_said_once(tmp_path, caplog):
    group = build_group(_config(tmp_path, max_components=2))
    group.setup()
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        group.record("loss_components", {"a": 1.0, "b": 2.0, "c": 3.0}, {"micro_step": 0})
        group.flush(1)
    errors = [r for r in caplog.records if "LossComponentsMonitor failed" in r.getMessage()]
    assert len(errors) == 1 and "max_components = 2" in str(errors[0].exc_info[1])
    group.close()


@pytest.mark.parametrize("section, message", [
    ({"enabled": 1}, "monitor.loss_components.enabled"),
    ({"enabled": True, "max_components": 0}, "monitor.loss_components.max_components"),
    ({"enabled": True, "max_components": "8"}, "monitor.loss_components.max_components"),
    ({"enabled": True, "components": ["lm loss"]}, "monitor.loss_components.components: unknown key"),
])
def test_bad_section_is_one_clean_line(section, message):
    with pytest.raises(ConfigError, match=message):
        parse_sections({"monitor": {"loss_components": section}})


def test_two_data_parallel_ranks_write_the_mean_over_both(tmp_path):
    """Real msrun workers over mccl: each rank's step value is the mean of both ranks' micro-batch values
    (read from the two ranks' own files), the same on both ranks."""
    from tests.support.msrun_launch import run_workers

    result, logs = run_workers("loss_components_worker.py", [tmp_path / "out", STEPS, K], tmp_path, 2)
    assert result.returncode == 0, result.stdout[-2000:] + "".join(log[-2000:] for log in logs.values())
    rows = {rank: read_jsonl(tmp_path / "out" / f"rank_{rank}" / "metrics.jsonl") for rank in (0, 1)}
    micro = {rank: [r for r in rows[rank] if r["kind"] == "loss_component"] for rank in (0, 1)}
    first = {rank: [r["value"] for r in micro[rank] if r["step"] == 1 and r["name"] == "lm loss"] for rank in (0, 1)}
    assert not np.allclose(first[0], first[1])   # the ranks' batches differ, so a rank's own mean would show
    for rank in (0, 1):
        steps = {(r["step"], r["name"]): r["value"] for r in rows[rank] if r["kind"] == "loss_component_step"}
        assert len(steps) == STEPS * 3
        for (step, name), value in steps.items():
            both = [r["value"] for m in micro.values() for r in m if r["step"] == step and r["name"] == name]
            assert len(both) == 2 * K
            assert value == pytest.approx(np.mean(both), rel=1e-5), (rank, step, name)


def test_the_report_draws_each_component(demo_run):
    from mindmon.analysis.report import loss_plot
    from mindmon.formats.jsonl import read_records

    tmp_path, expected = demo_run
    figure = loss_plot(read_records(str(tmp_path / "out" / "rank_0" / "metrics.jsonl")), K)
    curves = {line.get_label(): list(line.get_ydata()) for ax in figure.axes for line in ax.get_lines()}
    for name in ("lm loss", "load_balancing_loss", "mtp_1 loss"):
        want = [np.mean([expected[(s, k)][name] for k in range(K)]) for s in range(1, STEPS + 1)]
        assert curves[name] == pytest.approx(want, rel=1e-5)
