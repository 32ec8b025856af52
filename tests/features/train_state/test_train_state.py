"""train_state on the real MindFormers Trainer, checked against an independent numpy computation.

The reference replays step 1 with a fresh copy of the model (same seed, same init): plain
MindSpore `value_and_grad` per micro-batch of `local_batch_size` samples, then numpy for the
accumulation, norms and losses, following the seed doc's definitions.
"""
import numpy as np
import pytest
from mindspore import Tensor, value_and_grad

from tests.support.demo_trainer import make_data, make_model, train, trainer_config
from tests.support.jsonl import read_jsonl

K, LBS = 4, 2


def _reference_step1(config):
    """Per micro-batch: loss_k and the gradient of loss_k / K, by parameter name (numpy)."""
    model = make_model()
    model.set_train(True)
    names = [p.name for p in model.trainable_params()]
    batch = next(make_data(config).create_dict_iterator(output_numpy=True))
    grad_fn = value_and_grad(lambda ids, labels: model(ids, labels)[0], None, model.trainable_params())
    losses, grads = [], []
    for k in range(K):
        rows = slice(k * LBS, (k + 1) * LBS)
        loss, g = grad_fn(Tensor(batch["input_ids"][rows]), Tensor(batch["labels"][rows]))
        losses.append(float(loss.asnumpy()))
        grads.append({n: t.asnumpy().astype(np.float64) / K for n, t in zip(names, g)})
    return losses, grads, names


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_state")
    config = trainer_config(out, steps=3, monitor={"train_state": {
        "local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True}})
    trainer = train(config)
    return config, read_jsonl(out / "rank_0" / "metrics.jsonl"), trainer


def test_step1_matches_numpy(run):
    config, records, _ = run
    losses, grads, names = _reference_step1(config)
    step1 = [r for r in records if r["step"] == 1]
    by = {(r["kind"], r["micro_step"], r["name"]): r["value"] for r in step1}
    accumulated = {n: np.zeros_like(grads[0][n]) for n in names}
    previous = {n: 0.0 for n in names}
    for k in range(K):
        assert by[("local_loss", k, "loss")] == pytest.approx(losses[k], rel=1e-5)
        for n in names:
            accumulated[n] = accumulated[n] + grads[k][n]
            norm = np.linalg.norm(accumulated[n])
            assert by[("local_norm", k, n)] == pytest.approx(norm - previous[n], rel=1e-4, abs=1e-7)
            assert by[("micro_norm", k, n)] == pytest.approx(np.linalg.norm(grads[k][n]), rel=1e-4, abs=1e-7)
            previous[n] = norm
    for n in names:
        assert by[("device_norm", None, n)] == pytest.approx(previous[n], rel=1e-4, abs=1e-7)
    assert by[("device_loss", None, "loss")] == pytest.approx(np.mean(losses), rel=1e-5)


def test_every_step_is_complete_and_consistent(run):
    config, records, trainer = run
    names = [p.name for p in trainer.optimizer.parameters]
    for step in (1, 2, 3):
        rows = [r for r in records if r["step"] == step]
        for kind in ("local_loss", "local_norm", "micro_norm"):
            assert sorted({r["micro_step"] for r in rows if r["kind"] == kind}) == list(range(K))
        assert len([r for r in rows if r["kind"] == "local_norm"]) == K * len(names)
        assert len([r for r in rows if r["kind"] == "device_norm"]) == len(names)
        losses = [r["value"] for r in rows if r["kind"] == "local_loss"]
        device_loss = [r["value"] for r in rows if r["kind"] == "device_loss"]
        assert device_loss == [pytest.approx(np.mean(losses), rel=1e-5)]
        for n in names:  # the increments telescope to the accumulated norm
            increments = [r["value"] for r in rows if r["kind"] == "local_norm" and r["name"] == n]
            total = [r["value"] for r in rows if r["kind"] == "device_norm" and r["name"] == n]
            assert sum(increments) == pytest.approx(total[0], rel=1e-4, abs=1e-7)
        assert all(r["rank"] == 0 for r in rows)
    assert len({r["step"] for r in records}) == 3


def test_loss_changes_between_steps(run):
    """One optimizer update per step: step 2's first micro-batch sees updated weights."""
    _, records, _ = run
    first = {r["step"]: r["value"] for r in records if r["kind"] == "device_loss"}
    assert first[1] != first[2] != first[3]


def test_filters_select_exactly(tmp_path):
    config = trainer_config(tmp_path, steps=1, monitor={"train_state": {
        "local_norm": ["layernorm"], "device_norm": "layers.1.self_attention"}})
    trainer = train(config)
    records = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    names = [p.name for p in trainer.optimizer.parameters]
    local = {r["name"] for r in records if r["kind"] == "local_norm"}
    device = {r["name"] for r in records if r["kind"] == "device_norm"}
    assert local == {n for n in names if "layernorm" in n} and local
    assert device == {n for n in names if "layers.1.self_attention" in n} and device
    assert not [r for r in records if r["kind"] in ("local_loss", "device_loss")]


def test_only_device_norm_still_collects(tmp_path):
    config = trainer_config(tmp_path, steps=1, monitor={"train_state": {"device_norm": True}})
    trainer = train(config)
    step_values = {"loss", "grad_norm", "learning_rate", "samples", "max_norm"}   # MonitorCallback records these every step
    records = [r for r in read_jsonl(tmp_path / "rank_0" / "metrics.jsonl") if r["kind"] not in step_values]
    assert {r["kind"] for r in records} == {"device_norm"}
    assert len(records) == len(trainer.optimizer.parameters)


def test_filter_matching_nothing_fails_before_training(tmp_path):
    from mindmon.config import ConfigError
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, steps=1, monitor={"train_state": {"local_norm": ["atention"]}})
    with pytest.raises(ConfigError, match=r"monitor.train_state.local_norm: 'atention' matches no trainable"):
        Trainer(config=config, model=make_model(), train_dataset=make_data(config))


def test_yaml_error_stops_the_trainer_before_step_1(tmp_path):
    from mindmon.config import ConfigError
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, steps=1, monitor={"train_state": {"local_loss": "True"}})
    with pytest.raises(ConfigError, match=r"monitor.train_state.local_loss: got 'True' \(str\)"):
        Trainer(config=config, model=make_model(), train_dataset=make_data(config))


def test_batch_sizes_that_do_not_divide_are_rejected(tmp_path):
    from mindmon.config import ConfigError
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, steps=1, local_batch_size=3, global_batch_size=8,
                            monitor={"train_state": {"local_loss": True}})
    with pytest.raises(ConfigError, match=r"training.global_batch_size: got 8.*local_batch_size \(3\)"):
        Trainer(config=config, model=make_model(), train_dataset=make_data(config))
