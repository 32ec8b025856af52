"""The max-logit probe without the Trainer, against a float64 numpy max of QK^T * scale per query head:
every layout, grouped-query attention, an explicit scale, each kind of mask input, causal attention
with fewer queries than keys, float16 inputs, the tracking switch, reset and detach, the exact error
messages, and the function wrapper's routing. Fast: tiny tensors, no training."""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from mindmon.probes import attach_max_logit_probes, track_attention_function
from mindmon.features.max_logits.probe import MaxLogitProbe

pytestmark = pytest.mark.ms27

Q_HEADS, KV_HEADS, DIM = 4, 2, 8


class QK(nn.Cell):
    """Stands for an attention cell: takes (q, k, ...) and returns q."""

    def construct(self, q, k, *rest):
        return q


class Layers(nn.Cell):
    def __init__(self, count=2):
        super().__init__()
        self.layers = nn.CellList([QK() for _ in range(count)])


def numpy_max(q, k, scale=None, masked=None):
    """Per query head, the max over batch, queries and unmasked keys of (q . k) * scale in float64;
    q (b, Hq, Sq, d), k (b, Hkv, Sk, d); query head h reads key head h // (Hq / Hkv) (repeated K)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    keys = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    scores = q @ keys.swapaxes(-1, -2) * (1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if masked is not None:
        scores = np.where(np.broadcast_to(masked, scores.shape), -np.inf, scores)
    return scores.max(axis=(0, 2, 3))


def in_layout(x, layout):
    """A (b, heads, s, d) array in `layout`; TH flattens one sequence of batch 1 to (s, heads * d)."""
    b, heads, s, d = x.shape
    if layout == "BNSD":
        return x
    bsnd = x.transpose(0, 2, 1, 3)
    if layout == "BSND":
        return bsnd
    bsh = bsnd.reshape(b, s, heads * d)
    return bsh if layout == "BSH" else bsh[0]


def qk(rng, batch=2, q_len=3, k_len=5, dtype=np.float32):
    return (rng.normal(size=(batch, Q_HEADS, q_len, DIM)).astype(dtype),
            rng.normal(size=(batch, KV_HEADS, k_len, DIM)).astype(dtype))


def values(probes):
    return {name: value.asnumpy() for name, value in probes.get_max_attention_logit().items()}


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "TH"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_every_layout_is_a_running_max_of_numpys_grouped_scores(layout, scale):
    rng = np.random.default_rng(0)
    batch = 1 if layout == "TH" else 2
    model = Layers()
    probes = attach_max_logit_probes(model, r"layers\.\d$", num_heads=Q_HEADS, layout=layout, scale=scale,
                                     num_kv_heads=KV_HEADS)
    calls = [[qk(rng, batch) for _ in range(2)] for _ in range(2)]   # two forwards of two layers
    for forward in calls:
        for layer, (q, k) in zip(model.layers, forward):
            layer(ms.Tensor(in_layout(q, layout)), ms.Tensor(in_layout(k, layout)))
    got = values(probes)
    assert list(got) == ["layers.0.max_logits_val", "layers.1.max_logits_val"]
    for index in range(2):
        want = np.maximum(numpy_max(*calls[0][index], scale), numpy_max(*calls[1][index], scale))
        assert got[f"layers.{index}.max_logits_val"].dtype == np.float32
        np.testing.assert_allclose(got[f"layers.{index}.max_logits_val"], want, rtol=1e-5)
    model.reset_max_attention_logit()   # the accessor installed on the model
    for value in values(probes).values():
        assert value.dtype == np.float32 and value.shape == (Q_HEADS,) and np.isneginf(value).all()


def test_causal_with_fewer_queries_than_keys_sees_the_keys_up_to_each_querys_position():
    """The queries are the last q_len positions: query i sees keys j <= i + (k_len - q_len)."""
    rng = np.random.default_rng(1)
    model = Layers(1)
    probes = attach_max_logit_probes(model, r"layers\.0$", num_heads=Q_HEADS, num_kv_heads=KV_HEADS, causal=True)
    q, k = qk(rng, q_len=3, k_len=5)
    k[:, :, -1] += 50.0   # the last key dominates, and only the last query may see it
    model.layers[0](ms.Tensor(q), ms.Tensor(k))
    future = np.arange(5)[None, :] > np.arange(3)[:, None] + 2
    np.testing.assert_allclose(values(probes)["layers.0.max_logits_val"], numpy_max(q, k, masked=future), rtol=1e-5)


def _masks(rng):
    """(mask as given to the cell, True where masked) for each accepted kind of mask input: 4-d, or
    (query, key) after unit dimensions only."""
    masked = rng.random((2, 1, 3, 5)) < 0.5
    masked[..., 0] = False   # every query sees at least one key
    additive = np.where(masked, -1e4, 0.0).astype(np.float32)
    additive[~masked] = 0.5 * rng.random(int((~masked).sum()))   # non-negative values are not masked
    return [(masked, masked), (masked[0, 0], masked[0, 0]), (masked[:1, 0], masked[0, 0]),
            (masked[0, 0][None, None, None], masked[0, 0]), (masked.astype(np.int32), masked), (additive, masked),
            (np.zeros((3, 5), np.float32), np.zeros((3, 5), bool))]


@pytest.mark.parametrize("kind", range(7), ids=["bool4d", "bool2d", "bool3d", "bool5d", "int01", "additive", "zeros"])
def test_a_mask_input_masks_exactly_its_true_or_negative_entries(kind):
    rng = np.random.default_rng(2)
    mask, masked = _masks(rng)[kind]
    model = Layers(1)
    # causal is ignored when the cell has a mask input: the all-visible mask sees the future too
    probes = attach_max_logit_probes(model, r"layers\.0$", num_heads=Q_HEADS, num_kv_heads=KV_HEADS,
                                     mask_input=2, causal=True)
    q, k = qk(rng)
    k[:, :, -1] += 50.0
    model.layers[0](ms.Tensor(q), ms.Tensor(k), ms.Tensor(mask))
    np.testing.assert_allclose(values(probes)["layers.0.max_logits_val"], numpy_max(q, k, masked=masked), rtol=1e-5)


def test_multi_query_attention_one_key_head_for_every_query_head():
    rng = np.random.default_rng(9)
    model = Layers(1)
    probes = attach_max_logit_probes(model, r"layers\.0$", num_heads=Q_HEADS, num_kv_heads=1)
    q, k = qk(rng)
    model.layers[0](ms.Tensor(q), ms.Tensor(k[:, :1]))
    np.testing.assert_allclose(values(probes)["layers.0.max_logits_val"], numpy_max(q, k[:, :1]), rtol=1e-5)


def test_float16_inputs_are_multiplied_in_float32():
    rng = np.random.default_rng(3)
    model = Layers(1)
    probes = attach_max_logit_probes(model, r"layers\.0$", num_heads=Q_HEADS, num_kv_heads=KV_HEADS, scale=1.0)
    q, k = qk(rng, dtype=np.float16)
    q, k = q * 30, k * 30   # products of ~1e3: float16 arithmetic would be off by about 0.5
    model.layers[0](ms.Tensor(q), ms.Tensor(k))
    got = values(probes)["layers.0.max_logits_val"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, numpy_max(q, k, 1.0), rtol=1e-6)


def test_the_tracking_switch_and_a_model_without_it():
    rng = np.random.default_rng(4)
    model = Layers(1)
    probes = attach_max_logit_probes(model, r"layers\.0$", num_heads=Q_HEADS, num_kv_heads=KV_HEADS)
    assert model.track_max_attention_logit is True
    model.track_max_attention_logit = False
    q, k = qk(rng)
    model.layers[0](ms.Tensor(q), ms.Tensor(k))
    assert np.isneginf(values(probes)["layers.0.max_logits_val"]).all()
    model.track_max_attention_logit = True
    model.layers[0](ms.Tensor(q), ms.Tensor(k))
    np.testing.assert_allclose(values(probes)["layers.0.max_logits_val"], numpy_max(q, k), rtol=1e-5)
    bare = MaxLogitProbe("bare", object(), Q_HEADS, "BNSD", None, False, None, KV_HEADS)   # no switch: tracks
    bare.observe(ms.Tensor(q), ms.Tensor(k))
    np.testing.assert_allclose(bare.value.asnumpy(), numpy_max(q, k), rtol=1e-5)


def test_detach_removes_hooks_and_accessors_and_allows_a_new_attach():
    rng = np.random.default_rng(5)
    model = Layers(1)
    probes = attach_max_logit_probes(model, r"layers\.0$", num_heads=Q_HEADS, num_kv_heads=KV_HEADS)
    probes.detach()
    probes.detach()   # nothing left to remove, and no error
    for name in ("get_max_attention_logit", "reset_max_attention_logit", "track_max_attention_logit"):
        assert not hasattr(model, name)
    assert probes.probes[0].handle is None
    q, k = qk(rng)
    model.layers[0](ms.Tensor(q), ms.Tensor(k))
    assert np.isneginf(probes.probes[0].value.asnumpy()).all()   # the hook is gone
    again = attach_max_logit_probes(model, r"layers\.0$", num_heads=Q_HEADS, num_kv_heads=KV_HEADS)
    model.layers[0](ms.Tensor(q), ms.Tensor(k))
    np.testing.assert_allclose(values(again)["layers.0.max_logits_val"], numpy_max(q, k), rtol=1e-5)


def test_argument_errors_are_exact():
    model = Layers(1)
    for bad in (0, -2, 3):
        with pytest.raises(ValueError) as error:
            attach_max_logit_probes(model, r"layers\.0$", num_heads=Q_HEADS, num_kv_heads=bad)
        assert str(error.value) == f"num_kv_heads: got {bad}; allowed: a divisor of num_heads (4)"
    with pytest.raises(ValueError) as error:
        track_attention_function(model, lambda q, k: q, ["layers.0"], num_heads=Q_HEADS, layout="SBH")
    assert str(error.value) == "layout: got 'SBH'; allowed: ['BNSD', 'BSND', 'BSH', 'TH']"
    with pytest.raises(ValueError) as error:
        attach_max_logit_probes(model, r"attention$", num_heads=Q_HEADS)
    assert str(error.value).startswith("attach_max_logit_probes: the pattern 'attention$' matches no cell of Layers")
    model.get_max_attention_logit = lambda: {}
    with pytest.raises(ValueError) as error:
        track_attention_function(model, lambda q, k: q, ["layers.0"], num_heads=Q_HEADS)
    assert str(error.value) == ("Layers already has get_max_attention_logit(); it tracks its own max attention "
                                "logits, attach no probe")
    model.get_max_attention_logit = None   # not callable: the model does not track, a probe may attach
    attach_max_logit_probes(model, r"layers\.0$", num_heads=Q_HEADS)
    assert callable(model.get_max_attention_logit)


@pytest.mark.parametrize("layout, shape", [("BNSD", (2, 2, 5, 8)), ("BNSD", (2, 4, 5)), ("BSND", (2, 4, 5, 8)),
                                           ("BSH", (2, 5, 4, 8)), ("TH", (2, 5, 32))])
def test_a_shape_that_does_not_fit_detaches_the_probe_with_one_warning(caplog, layout, shape):
    model = Layers(1)
    probes = attach_max_logit_probes(model, r"layers\.0$", num_heads=Q_HEADS, layout=layout)
    x = ms.Tensor(np.ones(shape, np.float32))
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        model.layers[0](x, x)
        model.layers[0](x, x)
    assert [r.getMessage() for r in caplog.records] == [
        f"mindmon: max-logit probe layers.0.max_logits_val: got shape {shape}, expected {layout} with 4 heads; "
        f"the probe is detached and this layer is no longer tracked (check num_heads, num_kv_heads, layout)"]
    assert caplog.records[0].name == "mindmon"   # the logger users configure
    assert probes.probes[0].handle is None and probes.probes[0].model is None


def test_the_function_wrapper_routes_calls_by_order_and_passes_the_mask_argument():
    rng = np.random.default_rng(6)
    seen = []

    def attention(x, q, k, mask, *, flag=None):   # query, key and mask are arguments 1, 2 and 3
        seen.append(flag)
        return x
    names = ["layers.0", "layers.1", "layers.2"]
    probes, wrapped = track_attention_function(Layers(), attention, names=names, num_heads=Q_HEADS,
                                               num_kv_heads=KV_HEADS, query_arg=1, key_arg=2, mask_arg=3, scale=0.5)
    calls = [qk(rng) for _ in range(6)]   # two forwards, each calling the layers in order
    masks = [rng.random((3, 5)) < 0.3 for _ in range(6)]
    for (q, k), mask in zip(calls, masks):
        assert wrapped("x", ms.Tensor(q), ms.Tensor(k), ms.Tensor(mask), flag="on") == "x"
    assert seen == ["on"] * 6
    got = values(probes)
    for index, name in enumerate(names):
        want = np.maximum(numpy_max(*calls[index], 0.5, masks[index]), numpy_max(*calls[index + 3], 0.5, masks[index + 3]))
        np.testing.assert_allclose(got[f"{name}.max_logits_val"], want, rtol=1e-5)


def test_the_function_wrapper_asks_layer_of_and_ignores_unknown_layers():
    rng = np.random.default_rng(7)
    probes, wrapped = track_attention_function(Layers(), lambda prefix, q, k, *, flag: prefix,
                                               names=["layers.0", "layers.1"], num_heads=Q_HEADS,
                                               num_kv_heads=KV_HEADS, query_arg=1, key_arg=2,
                                               layer_of=lambda args, kwargs: args[0] + kwargs["flag"])
    (q, k), (q2, k2) = qk(rng), qk(rng)
    q[:, :, 0], k[:, :, 4] = 3.0, 3.0   # the peak is query 0 on key 4: counted, as the default is not causal
    assert wrapped("layers.", ms.Tensor(q), ms.Tensor(k), flag="1") == "layers."
    wrapped("embedding", ms.Tensor(q2), ms.Tensor(k2), flag="")   # no probe of that name: ignored
    got = values(probes)
    assert np.isneginf(got["layers.0.max_logits_val"]).all()
    np.testing.assert_allclose(got["layers.1.max_logits_val"], numpy_max(q, k), rtol=1e-5)


def test_a_wrapped_function_with_a_mismatched_probe_warns_once_and_keeps_calling(caplog):
    rng = np.random.default_rng(8)
    model = Layers(1)
    probes, wrapped = track_attention_function(model, lambda q, k: "out", names=["layers.0"], num_heads=Q_HEADS)
    q, k = qk(rng)   # two key heads where four are configured
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        assert [wrapped(ms.Tensor(q), ms.Tensor(k)) for _ in range(3)] == ["out"] * 3
    assert len(caplog.records) == 1 and "got shape (2, 2, 5, 8), expected BNSD with 4 heads" in caplog.text
    assert probes.probes[0].model is None
