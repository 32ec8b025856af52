"""Max-logit probes on grouped-query attention and on function-style attention, against numpy; a
probe whose configuration does not match what it receives detaches itself and never breaks the forward."""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, nn, ops

from mindmon.probes import attach_max_logit_probes, track_attention_function

pytestmark = pytest.mark.ms27   # also runs on MindSpore 2.7 (make test-ms27)

BATCH, Q_HEADS, KV_HEADS, SEQ, DIM = 2, 4, 2, 5, 8


def grouped_attention(q, k, v):
    """softmax(QK^T / sqrt(d)) V with K/V heads shared by groups of query heads, causal."""
    group = q.shape[1] // k.shape[1]
    k, v = ops.repeat_interleave(k, group, 1), ops.repeat_interleave(v, group, 1)
    scores = ops.matmul(q, k.swapaxes(-1, -2)) / float(np.sqrt(q.shape[-1]))
    future = ms.Tensor(np.triu(np.full((q.shape[2], k.shape[2]), -1e9, np.float32), k=1))
    return ops.matmul(mint.softmax(scores + future, dim=-1), v)


class GroupedAttention(nn.Cell):
    def construct(self, q, k, v):
        return grouped_attention(q, k, v)


class TwoLayers(nn.Cell):
    def __init__(self, attention):
        super().__init__()
        self.layers = nn.CellList([attention(), attention()])

    def construct(self, inputs):
        return [layer(*qkv) for layer, qkv in zip(self.layers, inputs)]


class FunctionLayers(nn.Cell):
    """Attention as a module-level function looked up at call time, as HuggingFace-style code does."""

    attention = staticmethod(grouped_attention)

    def construct(self, inputs):
        return [FunctionLayers.attention(*qkv) for qkv in inputs]


def _inputs(rng):
    return [tuple(ms.Tensor(rng.normal(size=(BATCH, heads, SEQ, DIM)).astype(np.float32))
                  for heads in (Q_HEADS, KV_HEADS, KV_HEADS)) for _ in range(2)]


def _numpy_max(q, k):
    """Per query head: max over batch and unmasked (causal) positions of q.k / sqrt(d), head h using
    key/value head h // (Q_HEADS // KV_HEADS)."""
    q, k = q.asnumpy().astype(np.float64), k.asnumpy().astype(np.float64)
    group = Q_HEADS // KV_HEADS
    allowed = np.tril(np.ones((SEQ, SEQ), bool))
    return np.array([(q[:, h] @ k[:, h // group].transpose(0, 2, 1) / np.sqrt(DIM))[:, allowed].max()
                     for h in range(Q_HEADS)])


def test_grouped_query_attention_cells_match_numpy():
    rng = np.random.default_rng(0)
    model = TwoLayers(GroupedAttention)
    probes = attach_max_logit_probes(model, r"layers\.\d$", num_heads=Q_HEADS, num_kv_heads=KV_HEADS, causal=True)
    first, second = _inputs(rng), _inputs(rng)
    model(first)
    model(second)
    values = probes.get_max_attention_logit()
    for index in range(2):
        want = np.maximum(_numpy_max(*first[index][:2]), _numpy_max(*second[index][:2]))   # running max
        np.testing.assert_allclose(values[f"layers.{index}.max_logits_val"].asnumpy(), want, rtol=1e-5)


def test_attention_function_wrapped_matches_numpy():
    rng = np.random.default_rng(1)
    model = FunctionLayers()
    probes, wrapped = track_attention_function(model, FunctionLayers.attention, names=["layers.0", "layers.1"],
                                               num_heads=Q_HEADS, num_kv_heads=KV_HEADS, causal=True)
    FunctionLayers.attention = staticmethod(wrapped)
    try:
        inputs = _inputs(rng)
        outputs = model(inputs)
    finally:
        FunctionLayers.attention = staticmethod(grouped_attention)
    np.testing.assert_allclose(outputs[0].asnumpy(), grouped_attention(*inputs[0]).asnumpy(), rtol=1e-6)
    values = probes.get_max_attention_logit()
    for index in range(2):
        np.testing.assert_allclose(values[f"layers.{index}.max_logits_val"].asnumpy(),
                                   _numpy_max(*inputs[index][:2]), rtol=1e-5)


def test_a_mismatched_probe_detaches_itself_and_the_forward_runs(caplog):
    rng = np.random.default_rng(2)
    model = TwoLayers(GroupedAttention)
    probes = attach_max_logit_probes(model, r"layers\.\d$", num_heads=Q_HEADS, causal=True)   # forgot num_kv_heads
    inputs = _inputs(rng)
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        for _ in range(3):
            outputs = model(inputs)
    np.testing.assert_allclose(outputs[1].asnumpy(), grouped_attention(*inputs[1]).asnumpy(), rtol=1e-6)
    warnings = [r.getMessage() for r in caplog.records if "max-logit probe" in r.getMessage()]
    assert len(warnings) == 2   # once per layer, not once per call
    assert "layers.0.max_logits_val: got shape (2, 2, 5, 8), expected BNSD with 4 heads" in warnings[0]
    assert all(probe.handle is None for probe in probes.probes)
    assert np.isneginf(probes.get_max_attention_logit()["layers.0.max_logits_val"].asnumpy()).all()
