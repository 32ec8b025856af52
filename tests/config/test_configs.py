"""Every scenario YAML in configs/ trains the demo (laid over configs/demo.yaml, as `mindmon demo
--config` does) and records what its scenario is about, and nothing it did not ask for."""
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.support.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
K = 4  # configs/demo.yaml: global batch 8 = 4 micro-batches of 2


def _demo(tmp_path, name, steps=2):
    from mindmon.demo.train import run

    run(str(ROOT / "configs" / name), steps=steps, output=str(tmp_path))
    return read_jsonl(tmp_path / "monitor" / "rank_0" / "metrics.jsonl")


def _kinds(records):
    """What the monitors recorded; the trainer's own per-step values (loss, lr, ...) are always there."""
    from mindmon.core.records import GRAD_NORM, LEARNING_RATE, LOSS, MAX_NORM, SAMPLES

    return Counter(r["kind"] for r in records if r["kind"] not in (GRAD_NORM, LEARNING_RATE, LOSS, SAMPLES, MAX_NORM))


def test_loss_only(tmp_path):
    records = _demo(tmp_path, "train_state_loss_only.yaml")
    assert _kinds(records) == {"device_loss": 2}


def test_layer_norms(tmp_path):
    records = _demo(tmp_path, "train_state_layer_norms.yaml")
    kinds = _kinds(records)
    assert set(kinds) == {"local_norm", "micro_norm", "local_loss"} and kinds["local_loss"] == 2 * K
    names = {r["name"] for r in records if r["kind"] == "local_norm"}
    assert names and all("attention" in n or "layernorm" in n for n in names)
    assert any("mlp" in n for n in names)  # pre_mlp_layernorm: a substring filter, not a prefix


def test_accumulation(tmp_path):
    from mindmon.demo.model import DemoModelConfig, DemoMoEGPT

    records = _demo(tmp_path, "train_state_accumulation.yaml")
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    trainable = {p.name for p in DemoMoEGPT(DemoModelConfig.from_dict(config["model"])).trainable_params()}
    assert {r["name"] for r in records if r["kind"] == "device_norm"} == trainable
    assert {r["name"] for r in records if r["kind"] == "local_norm"} == trainable
    for name in list(trainable)[:5]:  # the increments of one step add up to its device norm
        increments = sum(r["value"] for r in records if r["kind"] == "local_norm" and r["name"] == name and r["step"] == 2)
        device = [r["value"] for r in records if r["kind"] == "device_norm" and r["name"] == name and r["step"] == 2]
        assert increments == pytest.approx(device[0], rel=1e-9, abs=1e-12)


def test_moe_load_imbalance(tmp_path):
    records = _demo(tmp_path, "moe_load_imbalance.yaml", steps=3)
    written = sorted((r["step"], r["micro_step"], r["name"]) for r in records if r["kind"] == "tokens_per_expert")
    # global micro-steps 0 and 10 of 12 = (step 1, micro-step 0) and (step 3, micro-step 2)
    assert written == [(s, m, f"decoder.layers.{layer}") for s, m in ((1, 0), (3, 2)) for layer in (1, 2)]
    assert {r["name"] for r in records if r["kind"] == "moe_cv"} == {"decoder.layers.1", "decoder.layers.2"}
    megatron = read_jsonl(tmp_path / "monitor" / "tokens_per_expert" / "rank0.jsonl")
    assert [(m["iter"], m["layer"], len(m["tpe"])) for m in megatron] == [(1, 1, 1), (1, 2, 1), (3, 1, 1), (3, 2, 1)]


def test_max_logits(tmp_path):
    records = _demo(tmp_path, "max_logits.yaml")
    logits = [r for r in records if r["kind"] == "max_attention_logit"]
    assert Counter(r["step"] for r in logits) == {1: 4, 2: 4}  # 3 decoder layers + 1 MTP layer, every step
    assert all(len(r["value"]) == 4 and np.isfinite(r["value"]).all() for r in logits)


def test_muon_qk_clip(tmp_path):
    """1.9.0 cannot build Muon from `optimizer:`; the launch script passes its own instances."""
    from mindformers.core.optim.adamw import AdamW
    from mindformers.pynative.trainer import Trainer
    from mindspore.nn.learning_rate_schedule import PolynomialDecayLR

    from mindmon.callbacks import MaxLogitsMonitor
    from mindmon.demo.data import make_dataset
    from mindmon.demo.model import DemoModelConfig, DemoMoEGPT
    from mindmon.demo.train import overlay

    config = overlay(yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text()),
                     yaml.safe_load((ROOT / "configs" / "max_logits_muon_qk_clip.yaml").read_text()))
    config["training"]["steps"] = 2
    config["monitor"]["output_dir"] = str(tmp_path)
    model = DemoMoEGPT(DemoModelConfig.from_dict(config["model"]))
    schedule = PolynomialDecayLR(1e-3, 1e-4, decay_steps=2, power=1.0)
    trainer = Trainer(config=config, model=model, optimizer=AdamW(model.trainable_params(), learning_rate=schedule),
                      lr_scheduler=schedule, train_dataset=make_dataset(16, 16, 64, 8))
    trainer.train()
    monitors = [c for c in trainer.callback_handler.callbacks if isinstance(c, MaxLogitsMonitor)]
    assert [m.step_interval for m in monitors] == [50]
    assert model.track_max_attention_logit is True
    assert all(np.isneginf(v.asnumpy()).all() for v in model.get_max_attention_logit().values())  # reset at step end


def test_every_config_is_run_by_a_test():
    tests = "".join(path.read_text() for path in (ROOT / "tests").rglob("test_*.py"))
    for config in sorted(os.listdir(ROOT / "configs")):
        if config != "demo.yaml":
            assert re.search(re.escape(config) + r"|" + re.escape(config.split("_level")[0]), tests), \
                f"configs/{config} is run by no test"
