"""monitor.moe_monitor on the real Trainer: tokens per expert against an independent count of the
router's top-k choices, taken by forward hooks on the routers of the same run."""
import json

import numpy as np
import pytest

from tests.support.demo_trainer import (SMALL_MODEL, StepCounter, count_router_choices, make_data, mindformers_log,
                                        trainer_config)
from tests.support.jsonl import read_jsonl
from mindmon.config import ConfigError
from mindmon.features.moe_tokens.config import MoEMonitorConfig
from mindmon.demo.model import DemoModelConfig, DemoMoEGPT

K, TOPK, LBS, SEQ = 4, SMALL_MODEL["moe_router_topk"], 2, SMALL_MODEL["seq_length"]


def _run(tmp_path, moe_monitor, steps=2, **model_overrides):
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, steps=steps, monitor={"moe_monitor": moe_monitor})
    config["model"].update(model_overrides)
    model = DemoMoEGPT(DemoModelConfig.from_dict(config["model"]))
    counter = StepCounter()
    reference = count_router_choices(model, counter, model.config.moe_router_topk)
    Trainer(config=config, model=model, train_dataset=make_data(config), callbacks=[counter]).train()
    return reference, read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")


def _tpe_log_lines():
    return [json.loads(line[line.index('{"iter"'):]) for line in mindformers_log().splitlines() if '{"iter"' in line]


def test_every_micro_step_equals_router_count(tmp_path):
    reference, records = _run(tmp_path, {"save_tokens_per_expert_interval": 1})
    tpe = {(r["step"], r["micro_step"], r["name"]): r for r in records if r["kind"] == "tokens_per_expert"}
    assert set(tpe) == set(reference)
    assert {name for (_, _, name) in reference} == {"decoder.layers.1", "mtp.layers.0"}
    for key, expected in reference.items():
        step, micro_step, name = key
        assert tpe[key]["value"] == expected.tolist()
        assert tpe[key]["iter"] == (step - 1) * K + micro_step
        tokens = LBS * (SEQ if name.startswith("decoder") else SEQ - 1)  # MTP depth 1 sees seq - 1 tokens
        assert sum(tpe[key]["value"]) == tokens * TOPK

    # Log lines in upstream's JSON shape, MTP with its mtp_idx, one per (micro-step, layer).
    lines = {(l["step"], l["micro_step"], l["block"]): l for l in _tpe_log_lines()[-len(reference):]}
    assert lines[(2, 3, "decoder")] == {"iter": 7, "step": 2, "micro_step": 3, "block": "decoder", "layer": 1,
                                        "tpe": [reference[(2, 3, "decoder.layers.1")].tolist()]}
    assert lines[(1, 0, "mtp")] == {"iter": 0, "step": 1, "micro_step": 0, "block": "mtp", "mtp_idx": 0, "layer": 0,
                                    "tpe": [reference[(1, 0, "mtp.layers.0")].tolist()]}
    assert list(lines[(1, 0, "mtp")]) == ["iter", "step", "micro_step", "block", "mtp_idx", "layer", "tpe"]

    # Megatron's file: one line per (step, layer), one inner list per micro-batch.
    megatron = read_jsonl(tmp_path / "tokens_per_expert" / "rank0.jsonl")
    assert megatron[0] == {"iter": 1, "block": "decoder", "layer": 1,
                           "tpe": [reference[(1, k, "decoder.layers.1")].tolist() for k in range(K)]}
    assert [(m["iter"], m["block"]) for m in megatron] == [(1, "decoder"), (1, "mtp"), (2, "decoder"), (2, "mtp")]


def test_step_summaries(tmp_path):
    reference, records = _run(tmp_path, {"save_tokens_per_expert_interval": 1}, steps=1,
                              num_experts=8, moe_router_topk=1)
    summary = {(r["kind"], r["name"]): r["value"] for r in records if r["kind"].startswith("moe_")}
    for name in ("decoder.layers.1", "mtp.layers.0"):
        tokens = sum(reference[(1, k, name)] for k in range(K)).astype(float)
        assert summary[("moe_min_tokens", name)] == tokens.min()
        assert summary[("moe_max_tokens", name)] == tokens.max()
        assert summary[("moe_idle_experts", name)] == float(np.sum(tokens == 0))
        assert summary[("moe_max_over_mean", name)] == pytest.approx(tokens.max() / tokens.mean())
        assert summary[("moe_cv", name)] == pytest.approx(tokens.std() / tokens.mean())


def test_interval_counts_global_micro_steps(tmp_path):
    reference, records = _run(tmp_path, {"save_tokens_per_expert_interval": 3, "target_layers": [1]}, steps=3)
    written = sorted((r["step"], r["micro_step"]) for r in records if r["kind"] == "tokens_per_expert")
    assert written == [(1, 0), (1, 3), (2, 2), (3, 1)]  # iter 0, 3, 6, 9 of 12
    for r in records:
        if r["kind"] == "tokens_per_expert":
            assert r["name"] == "decoder.layers.1"
            assert r["value"] == reference[(r["step"], r["micro_step"], r["name"])].tolist()


def test_int_target_counts_decoder_layers_and_warns_on_dense(tmp_path):
    reference, records = _run(tmp_path, {"save_tokens_per_expert_interval": 4, "target_layers": 2},
                              steps=1, num_layers=3)
    names = {r["name"] for r in records if r["kind"] == "tokens_per_expert"}
    assert names == {"decoder.layers.1"}  # layer 0 is dense, layer 2 is outside range(2), MTP is not a decoder layer
    assert "decoder.layers.0 is not a MoE layer" in mindformers_log()
    assert {name for (_, _, name) in reference} == {"decoder.layers.1", "decoder.layers.2", "mtp.layers.0"}


def _select(model, target_layers):
    from mindmon.features.moe_tokens.monitor import select_layers
    import logging

    config = MoEMonitorConfig(save_tokens_per_expert_interval=1, target_layers=target_layers)
    return [layer.name for layer, _ in select_layers(model, config, logging.getLogger("test"))]


def test_target_layer_forms_select_exactly():
    model = DemoMoEGPT(DemoModelConfig.from_dict({**SMALL_MODEL, "num_layers": 4}))
    assert _select(model, None) == ["decoder.layers.1", "decoder.layers.2", "decoder.layers.3", "mtp.layers.0"]
    assert _select(model, 3) == ["decoder.layers.1", "decoder.layers.2"]
    assert _select(model, (3, 1)) == ["decoder.layers.3", "decoder.layers.1"]
    with pytest.raises(ConfigError, match=r"target_layers: got \(1, 7\); decoder layer\(s\) \[7\] do not exist"):
        _select(model, (1, 7))
    with pytest.raises(ConfigError, match="selects no MoE layer"):
        _select(model, (0,))


def test_dense_model_is_an_error_before_training(tmp_path):
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, monitor={"moe_monitor": {"save_tokens_per_expert_interval": 1}})
    config["model"]["first_moe_layer"] = 99
    config["model"]["mtp_num_layers"] = 0
    model = DemoMoEGPT(DemoModelConfig.from_dict(config["model"]))
    with pytest.raises(ConfigError, match="selects no MoE layer"):
        Trainer(config=config, model=model, train_dataset=make_data(config))
