"""MaxLogitsMonitor on the real Trainer: per-head values against numpy max(QK^T/sqrt(d)) of the same Q, K."""
import re
from collections import defaultdict

import numpy as np
import pytest

from tests.support.demo_trainer import StepCounter, make_data, make_model, mindformers_log, trainer_config
from tests.support.jsonl import read_jsonl
from mindmon.demo.model import CoreAttention


def _capture_reference(model, counter):
    """Forward hooks on every core attention: numpy running max per (step, layer, head)."""
    reference = defaultdict(lambda: None)

    def hook(name):
        def on_forward(cell, inputs, output):
            q, k, _, mask = (t.asnumpy().astype(np.float64) for t in inputs)
            d = cell.head_dim
            heads = []
            for h in range(cell.num_heads):
                scores = q[:, h * d:(h + 1) * d] @ k[:, h * d:(h + 1) * d].T / np.sqrt(d)
                heads.append(scores[mask == 0].max())
            key = (counter.step, name)
            previous = reference[key]
            reference[key] = np.array(heads) if previous is None else np.maximum(previous, heads)
        return on_forward

    for _, cell in model.cells_and_names():
        if isinstance(cell, CoreAttention):
            cell.register_forward_hook(hook(cell.max_logits_val.name))
    return reference


def _run(tmp_path, interval, steps):
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, steps=steps, monitor={"train_state": {"device_loss": True}},
                            callbacks=[{"type": "MaxLogitsMonitor", "step_interval": interval}])
    model = make_model()
    counter = StepCounter()
    reference = _capture_reference(model, counter)
    trainer = Trainer(config=config, model=model, train_dataset=make_data(config),
                      callbacks=[counter])
    trainer.train()
    return trainer, reference, read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")


def test_values_equal_numpy_every_step(tmp_path):
    trainer, reference, records = _run(tmp_path, interval=1, steps=2)
    assert type(trainer.callback_handler.callbacks[-2]).__module__ == "mindmon.features.max_logits.callback"
    logged = [r for r in records if r["kind"] == "max_attention_logit"]
    names = {name for (_, name) in reference}
    assert len(names) == 3  # two decoder layers and the MTP layer
    assert {(r["step"], r["name"]) for r in logged} == {(s, n) for s in (1, 2) for n in names}
    for r in logged:
        np.testing.assert_allclose(r["value"], reference[(r["step"], r["name"])], rtol=1e-5, atol=1e-6)
    text = mindformers_log()
    for name in names:
        heads = ", ".join(f"{v:.4g}" for v in reference[(2, name)])
        assert f"step:[    2/    2] max_attention_logit/{name}: [{heads}]" in text
    every_head = np.concatenate([reference[(2, n)] for n in sorted(names)])
    assert f"step:[    2/    2] max_attention_logit/mean: {every_head.mean():.4g}" in text
    assert f"step:[    2/    2] max_attention_logit/max: {every_head.max():.4g}" in text


def test_interval_prints_every_third_step_and_resets_every_step(tmp_path):
    _, reference, records = _run(tmp_path, interval=3, steps=6)
    printed = sorted({int(m) for m in re.findall(r"step:\[\s+(\d+)/\s+6\] max_attention_logit/max", mindformers_log())})
    assert printed == [3, 6]
    logged = [r for r in records if r["kind"] == "max_attention_logit"]
    assert {r["step"] for r in logged} == {3, 6}
    for r in logged:  # step 6 holds step 6's micro-steps only: the running max was reset at steps 4 and 5
        np.testing.assert_allclose(r["value"], reference[(r["step"], r["name"])], rtol=1e-5, atol=1e-6)


def test_bad_interval_fails_at_construction():
    from mindmon.callbacks import MaxLogitsMonitor

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="step_interval"):
            MaxLogitsMonitor(step_interval=bad)


def _muon_run(tmp_path, optimizer_section, callbacks=None):
    """The YAML names Muon with QK clip; 1.9.0 cannot build Muon from config (it builds AdamW only),
    so, as a 1.9.0 user would, the launch script passes optimizer and scheduler instances."""
    from mindformers.core.optim.adamw import AdamW
    from mindformers.pynative.trainer import Trainer
    from mindspore.nn.learning_rate_schedule import PolynomialDecayLR

    config = trainer_config(tmp_path, monitor={"train_state": {"device_loss": True}}, optimizer=optimizer_section,
                            **({"callbacks": callbacks} if callbacks else {}))
    model = make_model()
    counter = StepCounter()
    reference = _capture_reference(model, counter)
    schedule = PolynomialDecayLR(1e-2, 1e-3, decay_steps=2, power=1.0)
    trainer = Trainer(config=config, model=model, train_dataset=make_data(config), callbacks=[counter],
                      optimizer=AdamW(model.trainable_params(), learning_rate=schedule), lr_scheduler=schedule)
    trainer.train()
    return trainer, model, reference, read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")


def test_muon_qk_clip_turns_tracking_on_and_adds_a_resetting_monitor(tmp_path):
    from mindmon.callbacks import MaxLogitsMonitor

    trainer, model, reference, records = _muon_run(tmp_path, {"type": "Muon", "qk_clip_enabled": True})
    added = [c for c in trainer.callback_handler.callbacks if isinstance(c, MaxLogitsMonitor)]
    assert len(added) == 1 and added[0].step_interval == 1
    assert model.track_max_attention_logit is True
    logged = [r for r in records if r["kind"] == "max_attention_logit"]
    assert {r["step"] for r in logged} == {1, 2}
    for r in logged:  # step 2 equals step 2's own max: the added monitor reset it after step 1
        np.testing.assert_allclose(r["value"], reference[(r["step"], r["name"])], rtol=1e-5, atol=1e-6)


def test_muon_with_explicit_monitor_keeps_its_interval(tmp_path):
    from mindmon.callbacks import MaxLogitsMonitor

    trainer, model, _, records = _muon_run(tmp_path, {"type": "Muon", "qk_clip_enabled": True},
                                           callbacks=[{"type": "MaxLogitsMonitor", "step_interval": 2}])
    monitors = [c for c in trainer.callback_handler.callbacks if isinstance(c, MaxLogitsMonitor)]
    assert [m.step_interval for m in monitors] == [2]
    assert {r["step"] for r in records if r["kind"] == "max_attention_logit"} == {2}


def test_qk_clip_without_muon_does_not_track(tmp_path):
    from mindmon.callbacks import MaxLogitsMonitor

    trainer, model, _, records = _muon_run(tmp_path, {"type": "AdamW", "qk_clip_enabled": True})
    assert not any(isinstance(c, MaxLogitsMonitor) for c in trainer.callback_handler.callbacks)
    assert model.track_max_attention_logit is False
    assert "optimizer.qk_clip_enabled is True but the optimizer is AdamW, not Muon" in mindformers_log()
