"""Probes on a model that tracks nothing itself: MaxLogitsMonitor and moe_monitor work unchanged on
the real Trainer, and their values equal numpy recomputations from the same Q, K and router scores."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, nn, ops

from tests.support.demo_trainer import SMALL_MODEL, StepCounter, count_router_choices, make_data, trainer_config
from tests.support.jsonl import read_jsonl
from mindmon.demo.model import DemoModelConfig, DemoMoEGPT, Experts, Linear, Router, WordEmbedding
from mindmon.probes import attach_max_logit_probes, attach_tokens_per_expert_probes

HEADS, TOPK = SMALL_MODEL["num_attention_heads"], SMALL_MODEL["moe_router_topk"]


class BatchedAttention(nn.Cell):
    """softmax(QK^T / sqrt(d)) V on (batch, heads, seq, head_dim), causal, no max tracking."""

    def construct(self, q, k, v):
        seq = q.shape[2]
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / float(np.sqrt(q.shape[-1]))
        future = ms.Tensor(np.triu(np.full((seq, seq), -1e9, np.float32), k=1))
        return ops.matmul(mint.softmax(scores + future, dim=-1), v)


class PlainMoE(nn.Cell):
    """Top-k routed experts with no tokens_per_expert counter."""

    def __init__(self, cfg, rng):
        super().__init__()
        self.router, self.experts, self.cfg = Router(cfg, rng), Experts(cfg, rng), cfg

    def construct(self, tokens):
        probs = mint.softmax(self.router(tokens), dim=-1)
        top_probs, top_index = ops.topk(probs, self.cfg.moe_router_topk)
        chosen = ops.one_hot(top_index, self.cfg.num_experts, ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32))
        return self.experts(tokens, (chosen * top_probs.expand_dims(-1)).sum(axis=1))


class PlainLayer(nn.Cell):
    def __init__(self, cfg, rng):
        super().__init__()
        self.cfg = cfg
        self.linear_qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, rng, 0.3)
        self.core_attention = BatchedAttention()
        self.mlp = PlainMoE(cfg, rng)

    def construct(self, x, batch):
        seq, d = x.shape[0] // batch, self.cfg.hidden_size // HEADS
        q, k, v = (t.reshape(batch, seq, HEADS, d).transpose(0, 2, 1, 3)
                   for t in mint.split(self.linear_qkv(x), self.cfg.hidden_size, dim=-1))
        x = x + self.core_attention(q, k, v).transpose(0, 2, 1, 3).reshape(batch * seq, -1)
        return x + self.mlp(x)


class PlainDecoder(nn.Cell):
    def __init__(self, cfg, rng):
        super().__init__()
        self.layers = nn.CellList([PlainLayer(cfg, rng) for _ in range(2)])


class PlainMoEGPT(nn.Cell):
    """A model that keeps neither max logits nor tokens per expert (most MindSpore models)."""

    get_gpt_transformer_config = DemoMoEGPT.get_gpt_transformer_config  # for MindFormers' LossCallback

    def __init__(self):
        super().__init__()
        self.config = DemoModelConfig.from_dict({**SMALL_MODEL, "mtp_num_layers": 0})
        rng = np.random.default_rng(5)
        self.word_embeddings = WordEmbedding(self.config, rng)
        self.decoder = PlainDecoder(self.config, rng)
        self.output_layer = Linear(self.config.hidden_size, self.config.vocab_size, rng, 0.05)

    def construct(self, input_ids, labels):
        x = self.word_embeddings(input_ids)
        for layer in self.decoder.layers:
            x = layer(x, input_ids.shape[0])
        logits = self.output_layer(x)
        one_hot = ops.one_hot(labels.reshape(-1), self.config.vocab_size, ms.Tensor(1.0, ms.float32),
                              ms.Tensor(0.0, ms.float32))
        return (-(ops.log_softmax(logits, -1) * one_hot).sum(axis=-1).mean(),)


def _max_logit_reference(model, counter):
    """numpy, from the same Q and K the probes see: max of causal QK^T/sqrt(d) per head, running over each step."""
    max_logits = {}

    def on_attention(name):
        def hook(cell, inputs, output):
            q, k = (t.asnumpy().astype(np.float64) for t in inputs[:2])
            scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
            causal = np.triu(np.ones(scores.shape[-2:], bool), k=1)
            heads = np.where(causal, -np.inf, scores).max(axis=(0, 2, 3))
            key = (counter.step, f"{name}.max_logits_val")
            max_logits[key] = np.maximum(max_logits.get(key, -np.inf), heads)
        return hook

    for name, cell in model.cells_and_names():
        if isinstance(cell, BatchedAttention):
            cell.register_forward_hook(on_attention(name))
    return max_logits


def test_probes_feed_both_monitors(tmp_path):
    from mindformers.pynative.trainer import Trainer

    model = PlainMoEGPT()
    counter = StepCounter()
    max_logits = _max_logit_reference(model, counter)
    tokens = count_router_choices(model, counter, TOPK)
    attach_max_logit_probes(model, r"core_attention$", num_heads=HEADS, layout="BNSD", causal=True)
    attach_tokens_per_expert_probes(model, r"mlp\.router$", num_experts=SMALL_MODEL["num_experts"], topk=TOPK)
    config = trainer_config(tmp_path, monitor={"moe_monitor": {"save_tokens_per_expert_interval": 1}},
                            callbacks=[{"type": "MaxLogitsMonitor", "step_interval": 1}])
    Trainer(config=config, model=model, train_dataset=make_data(config), callbacks=[counter]).train()
    records = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")

    logits = [r for r in records if r["kind"] == "max_attention_logit"]
    assert {(r["step"], r["name"]) for r in logits} == set(max_logits)
    assert len(max_logits) == 4  # 2 steps x 2 layers: reset between steps, else step 2 would hold step 1's max
    for r in logits:
        np.testing.assert_allclose(r["value"], max_logits[(r["step"], r["name"])], rtol=1e-5, atol=1e-6)

    routed = {(r["step"], r["micro_step"], r["name"]): r["value"] for r in records if r["kind"] == "tokens_per_expert"}
    assert set(routed) == set(tokens) and len(tokens) == 2 * 4 * 2
    for key, expected in tokens.items():
        assert routed[key] == expected.tolist()
        assert sum(routed[key]) == 2 * SMALL_MODEL["seq_length"] * TOPK


class DemoWithoutAccessors(DemoMoEGPT):
    """The demo model minus the accessors: its attention still fills `max_logits_val` while tracking."""

    get_max_attention_logit = None
    reset_max_attention_logit = None


@pytest.mark.ms27
def test_mask_input_and_flattened_layout_match_the_demo_models_own_tracking():
    """A probe on the demo's core attention (TH layout, additive mask as input 3) must report what the
    demo's own in-kernel tracking computes: a second, independent implementation."""
    model = DemoWithoutAccessors(DemoModelConfig.from_dict(SMALL_MODEL))
    probes = attach_max_logit_probes(model, r"core_attention$", num_heads=HEADS, layout="TH", mask_input=3)
    ids = ms.Tensor(np.random.default_rng(1).integers(0, SMALL_MODEL["vocab_size"], (2, SMALL_MODEL["seq_length"])),
                    ms.int32)
    model(ids, ids)
    model(ids[:1], ids[:1])  # a second call: both keep a running max
    probed = probes.get_max_attention_logit()
    own = {cell.max_logits_val.name: cell.max_logits_val for _, cell in model.cells_and_names()
           if hasattr(cell, "max_logits_val")}
    assert set(probed) == set(own) and len(own) == 3
    for name, value in own.items():
        assert np.isfinite(value.asnumpy()).all()
        np.testing.assert_allclose(probed[name].asnumpy(), value.asnumpy(), rtol=1e-5)


@pytest.mark.ms27
def test_bad_probe_arguments_name_what_is_allowed():
    model = PlainMoEGPT()
    with pytest.raises(ValueError, match=r"matches no cell of PlainMoEGPT; allowed: a regular expression"):
        attach_max_logit_probes(model, r"no_such_cell", num_heads=HEADS)
    with pytest.raises(ValueError, match=r"layout: got 'NSD'; allowed"):
        attach_max_logit_probes(model, r"core_attention$", num_heads=HEADS, layout="NSD")
    with pytest.raises(ValueError, match=r"topk: got 9; allowed: 1..num_experts \(4\)"):
        attach_tokens_per_expert_probes(model, r"router$", num_experts=4, topk=9)
    with pytest.raises(ValueError, match="already has get_max_attention_logit"):
        attach_max_logit_probes(DemoMoEGPT(DemoModelConfig.from_dict(SMALL_MODEL)), r"core_attention$", num_heads=HEADS)
