"""FLOPs and MFU (mindmon/features/speed/flops.py, peaks.py): two real MindSpore models run forward and
backward, and the counter's executed and useful FLOPs equal counts written out here from the shapes."""
import logging

import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops

from mindmon.features.speed.flops import AttentionSpec, ExpertSpec, FlopCounter, StepFlops, mfu
from mindmon.features.speed.peaks import PeakFinder, find_device, peak_flops

BATCH, SEQ, HIDDEN, HEADS, FFN, VOCAB, LAYERS = 2, 8, 16, 2, 32, 24, 2
TOKENS = BATCH * SEQ


def _dense(rng, fan_in, fan_out, bias=True):
    weight = Tensor(rng.normal(0, 0.1, (fan_out, fan_in)).astype(np.float32))
    return nn.Dense(fan_in, fan_out, weight_init=weight, has_bias=bias,
                    bias_init=Tensor(np.zeros(fan_out, np.float32)) if bias else None)


class CoreAttention(nn.Cell):
    """Causal softmax(Q K^T / sqrt(d)) V on (batch, seq, hidden) inputs, heads by BatchMatMul."""

    def __init__(self):
        super().__init__()
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.context = ops.BatchMatMul()
        self.mask = Tensor(np.triu(np.full((SEQ, SEQ), -1e9, np.float32), k=1))

    def construct(self, q, k, v):
        q, k, v = (ops.transpose(t.reshape(BATCH, SEQ, HEADS, -1), (0, 2, 1, 3)) for t in (q, k, v))
        probs = mint.softmax(self.scores(q, k) / float(np.sqrt(HIDDEN // HEADS)) + self.mask, dim=-1)
        return ops.transpose(self.context(probs, v), (0, 2, 1, 3)).reshape(BATCH, SEQ, HIDDEN)


class Block(nn.Cell):
    def __init__(self, rng):
        super().__init__()
        self.q, self.k, self.v, self.o = (_dense(rng, HIDDEN, HIDDEN) for _ in range(4))
        self.core_attention = CoreAttention()
        self.fc1, self.fc2 = _dense(rng, HIDDEN, FFN), _dense(rng, FFN, HIDDEN)

    def construct(self, x):
        x = x + self.o(self.core_attention(self.q(x), self.k(x), self.v(x)))
        return x + self.fc2(ops.relu(self.fc1(x)))


class Logits:
    """The tied output layer multiplies by the embedding table with a functional matmul, looked up here."""
    matmul = staticmethod(ops.matmul)


class DenseGPT(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.embedding = Parameter(Tensor(rng.normal(0, 0.1, (VOCAB, HIDDEN)).astype(np.float32)), name="emb")
        self.blocks = nn.CellList([Block(rng) for _ in range(LAYERS)])

    def construct(self, ids, labels):
        x = ops.gather(self.embedding, ids, 0)
        for block in self.blocks:
            x = block(x)
        logits = Logits.matmul(x, ops.transpose(self.embedding, (1, 0))).reshape(TOKENS, VOCAB)
        return ops.cross_entropy(logits, labels.reshape(-1))


# The MoE model: top-1 routing planted by the embedding's first feature (+1 for even token ids, -1 for
# odd) and the router's weights (expert 0 reads +feature 0, expert 3 reads -feature 0): even ids go to
# expert 0, odd ids to expert 3, experts 1 and 2 get nothing. Each expert keeps at most CAPACITY tokens
# (the first ones in token order) and drops the rest. Experts have different widths, so the useful
# count depends on which expert got which tokens. Every expert runs on every token (the demo's way).
EXPERT_FFN = (8, 16, 24, 32)
CAPACITY = 8


class Expert(nn.Cell):
    def __init__(self, rng, ffn):
        super().__init__()
        self.fc1, self.fc2 = _dense(rng, HIDDEN, ffn, bias=False), _dense(rng, ffn, HIDDEN, bias=False)

    def construct(self, x):
        return self.fc2(ops.relu(self.fc1(x)))


class MoEModel(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(1)
        table = rng.normal(0, 0.1, (VOCAB, HIDDEN)).astype(np.float32)
        table[:, 0] = np.where(np.arange(VOCAB) % 2 == 0, 1.0, -1.0)
        self.embedding = Parameter(Tensor(table), name="emb")
        router = np.zeros((len(EXPERT_FFN), HIDDEN), np.float32)
        router[0, 0], router[3, 0] = 4.0, -4.0
        self.router = nn.Dense(HIDDEN, len(EXPERT_FFN), weight_init=Tensor(router), has_bias=False)
        self.experts = nn.CellList([Expert(rng, ffn) for ffn in EXPERT_FFN])
        self.output_layer = _dense(rng, HIDDEN, VOCAB, bias=False)
        self.tokens_per_expert = Tensor(np.zeros(len(EXPERT_FFN), np.float32))

    def construct(self, ids, labels):
        x = ops.gather(self.embedding, ids.reshape(-1), 0)
        probs = mint.softmax(self.router(x), dim=-1)
        chosen = ops.one_hot(ops.argmax(probs, -1), len(EXPERT_FFN), Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        kept = chosen * (ops.cumsum(chosen, 0) <= CAPACITY).astype(ms.float32)
        self.tokens_per_expert = self.tokens_per_expert + ops.stop_gradient(kept.sum(0))
        gates = kept * probs
        out = x
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * gates[:, e:e + 1]
        return ops.cross_entropy(self.output_layer(out), labels.reshape(-1))


def _batch(ids=None):
    rng = np.random.default_rng(2)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)) if ids is None else ids
    labels = rng.integers(0, VOCAB, (BATCH, SEQ))
    return Tensor(ids.astype(np.int32)), Tensor(labels.astype(np.int32))


def _train_step(model, ids, labels):
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    loss, grads = grad_fn(ids, labels)
    assert np.isfinite(loss.asnumpy()) and len(grads) == len(model.trainable_params())


def _dense_gpt_counts():
    """(forward FLOPs the hardware runs, forward FLOPs of useful work) of DenseGPT on one batch."""
    head_dim = HIDDEN // HEADS
    projections = 4 * 2 * TOKENS * HIDDEN * HIDDEN
    mlp = 2 * TOKENS * HIDDEN * FFN + 2 * TOKENS * FFN * HIDDEN
    # scores and context: each (batch * heads) matmuls of (seq x head_dim) by (head_dim x seq), all pairs
    attention_run = 2 * (2 * BATCH * HEADS * SEQ * SEQ * head_dim)
    # a causal query t sees t + 1 keys: SEQ * (SEQ + 1) / 2 pairs per sequence, per matmul, per head
    attention_useful = 2 * (2 * BATCH * HEADS * (SEQ * (SEQ + 1) // 2) * head_dim)
    logits = 2 * TOKENS * HIDDEN * VOCAB
    run = LAYERS * (projections + mlp + attention_run) + logits
    useful = LAYERS * (projections + mlp + attention_useful) + logits
    return run, useful, projections + mlp + attention_run


@pytest.fixture
def dense_gpt():
    model = DenseGPT()
    counter = FlopCounter(model, AttentionSpec(r"core_attention$", layout="BSH", causal=True))
    saved = Logits.matmul
    Logits.matmul = staticmethod(counter.wrap(saved))
    yield model, counter
    Logits.matmul = staticmethod(saved)
    counter.detach()


def test_dense_gpt_training_step_counts_every_matmul_three_times(dense_gpt):
    model, counter = dense_gpt
    _train_step(model, *_batch())
    run, useful, _ = _dense_gpt_counts()
    assert counter.take_step() == StepFlops(useful=3 * useful, executed=3 * run)
    # the count restarts at every step
    _train_step(model, *_batch())
    assert counter.take_step() == StepFlops(useful=3 * useful, executed=3 * run)
    assert useful < run   # the masked half of the scores is run, not useful


def test_forward_without_gradient_counts_once(dense_gpt):
    model, counter = dense_gpt
    model(*_batch())
    run, useful, _ = _dense_gpt_counts()
    assert counter.take_step() == StepFlops(useful=useful, executed=run)


def test_recompute_adds_the_second_forward_to_executed_only(dense_gpt):
    model, counter = dense_gpt
    model.blocks[0].recompute()
    _train_step(model, *_batch())
    run, useful, block = _dense_gpt_counts()
    # block 0 runs without gradient in the forward, then again with it inside the backward
    assert counter.take_step() == StepFlops(useful=3 * useful, executed=3 * run + block)


def test_detach_restores_the_model():
    model = DenseGPT()
    counter = FlopCounter(model, AttentionSpec(r"core_attention$", layout="BSH"))
    assert type(model.blocks[0].q.matmul).__name__ != "MatMul"   # wrapped while attached
    counter.detach()
    model(*_batch())
    assert counter.take_step() == StepFlops(useful=0, executed=0)
    assert type(model.blocks[0].q.matmul).__name__ == "MatMul"


MOE_IDS = np.array([[0, 2, 4, 6, 8, 10, 1, 3], [12, 14, 16, 18, 5, 20, 7, 22]])


def test_moe_useful_counts_routed_kept_tokens_per_expert():
    even = int((MOE_IDS % 2 == 0).sum())
    kept = [min(even, CAPACITY), 0, 0, min(TOKENS - even, CAPACITY)]
    assert kept == [8, 0, 0, 4] and even - CAPACITY == 4   # the planted imbalance: 4 tokens dropped
    model = MoEModel()
    counter = FlopCounter(model, experts=ExpertSpec(r"^(?P<layer>experts)\.(?P<expert>\d+)$"))
    _train_step(model, *_batch(MOE_IDS))
    np.testing.assert_array_equal(model.tokens_per_expert.asnumpy(), kept)   # the model routed as planted
    step = counter.take_step(routed={"experts": kept})

    per_token = [2 * HIDDEN * ffn + 2 * ffn * HIDDEN for ffn in EXPERT_FFN]
    router, output = 2 * TOKENS * HIDDEN * len(EXPERT_FFN), 2 * TOKENS * HIDDEN * VOCAB
    run = router + output + TOKENS * sum(per_token)
    useful = router + output + sum(n * f for n, f in zip(kept, per_token))
    assert step == StepFlops(useful=3 * useful, executed=3 * run)
    assert useful == router + output + 8 * per_token[0] + 4 * per_token[3]


def test_moe_without_routed_counts_has_no_useful_flops(caplog):
    model = MoEModel()
    counter = FlopCounter(model, experts=ExpertSpec(r"^(?P<layer>experts)\.(?P<expert>\d+)$"))
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        for _ in range(2):
            _train_step(model, *_batch(MOE_IDS))
            step = counter.take_step()
            assert step.useful is None and step.executed > 0
    assert len([r for r in caplog.records if "no routed counts" in r.getMessage()]) == 1


def test_packed_sequences_count_attention_at_their_lengths(dense_gpt):
    """Two sequences of 3 and 5 tokens packed in each row of SEQ = 8: attention pairs per row are
    3*4/2 + 5*6/2 (causal) and 3*3 + 5*5 (not causal), whatever the kernel ran."""
    model, _ = dense_gpt
    for causal, pairs in ((True, 6 + 15), (False, 9 + 25)):
        spec = AttentionSpec(r"core_attention$", layout="BSH", causal=causal,
                             sequence_lengths=lambda cell, inputs: [3, 5] * inputs[0].shape[0])
        q = Tensor(np.zeros((BATCH, SEQ, HIDDEN), np.float32))
        assert spec.useful_flops(None, (q, q, q)) == 2 * 2 * BATCH * pairs * HIDDEN


def test_mfu_is_flops_over_time_over_peak():
    peak = peak_flops("CPU", "bfloat16", override_tflops=2.5)
    assert peak.flops_per_second == 2.5e12 and "peak_tflops" in peak.source
    assert mfu(7_500_000_000_000, 1.5, peak.flops_per_second) == pytest.approx(2.0)
    assert mfu(3_000_000_000, 0.25, 2.5e12) == pytest.approx(3e9 / 0.25 / 2.5e12)
    assert mfu(None, 1.0, 2.5e12) is None and mfu(10, 0.0, 2.5e12) is None


def test_known_devices_have_sourced_peaks():
    a100 = peak_flops("NVIDIA A100-SXM4-80GB", ms.bfloat16)
    assert a100.flops_per_second == 312e12 and "A100" in a100.source and "datasheet" in a100.source.lower()
    h100 = peak_flops("NVIDIA H100 80GB HBM3", "bfloat16")
    assert h100.flops_per_second == pytest.approx(989.5e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "int4").flops_per_second is None
    # the PCIe H100 is not taken for the SXM one, whose name it also contains
    assert peak_flops("NVIDIA H100 PCIe", "bf16").flops_per_second == pytest.approx(756.5e12)
    assert peak_flops("Tesla V100-SXM2-32GB", ms.float16).flops_per_second == 125e12
    assert peak_flops("Tesla V100-SXM2-32GB", ms.bfloat16).flops_per_second is None   # no bf16 on V100
    assert peak_flops("Ascend910A", "float16").flops_per_second == 256e12
    assert peak_flops("Ascend910B2", "float16").flops_per_second is None   # no per-SoC figure published


@pytest.mark.parametrize("name, label", [
    ("Ascend910B1", "Ascend 910B"), ("Ascend910B2", "Ascend 910B"), ("Ascend910B2C", "Ascend 910B"),
    ("Ascend910B3", "Ascend 910B"), ("Ascend910B4", "Ascend 910B"), ("Ascend910B4-1", "Ascend 910B"),
    ("Ascend910_9391", "Ascend 910C (one die)"), ("Ascend910_9392", "Ascend 910C (one die)"),
    ("Ascend910_9381", "Ascend 910C (one die)"), ("Ascend910_9382", "Ascend 910C (one die)"),
    ("Ascend910_9372", "Ascend 910C (one die)"), ("Ascend910_9362", "Ascend 910C (one die)"),
    ("NVIDIA A800-SXM4-80GB", "NVIDIA A800 (SXM4, PCIe)"), ("NVIDIA A800 80GB PCIe", "NVIDIA A800 (SXM4, PCIe)"),
    ("NVIDIA H800", "NVIDIA H800"), ("NVIDIA H800 PCIe", "NVIDIA H800"), ("NVIDIA H20", "NVIDIA H20"),
])
def test_recognised_devices_without_a_citable_figure_have_no_peak_and_say_why(name, label):
    assert find_device(name).label == label
    for dtype in ("bfloat16", "float16", "float32"):
        peak = peak_flops(name, dtype)
        assert peak.flops_per_second is None
        assert label in peak.source and "no vendor datasheet" in peak.source and name in peak.source


def test_the_lookup_keeps_the_older_and_neighbouring_names_apart():
    a800 = peak_flops("NVIDIA A800 40GB Active", "bfloat16")
    assert a800.flops_per_second == 312e12 and "A800 40GB Active datasheet" in a800.source
    assert peak_flops("NVIDIA A800 40GB Active", "float32").flops_per_second == 19.5e12
    assert find_device("Ascend910B") is None            # the older 910 (910 Pro B), not a 910B1..B4
    assert find_device("Ascend910ProA") is None
    assert find_device("Ascend910A").label == "Ascend 910 (910A)"
    assert find_device("NVIDIA H200") is None           # not the H20
    assert find_device("NVIDIA H100 80GB HBM3").label == "NVIDIA H100 SXM"


def test_unknown_device_has_no_mfu_and_says_so_once(caplog):
    finder = PeakFinder()
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        peaks = [finder.find("CPU", ms.float32, None) for _ in range(3)]
    assert all(p.flops_per_second is None for p in peaks)
    assert mfu(10 ** 12, 1.0, peaks[0].flops_per_second) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "CPU" in lines[0] and "peak_tflops" in lines[0], lines


# The demo model at configs/demo.yaml's sizes, trained by a plain loop: 4 micro-batches of 2 sequences of 16.
DEMO = {"vocab_size": 64, "hidden_size": 32, "ffn_hidden_size": 64, "num_layers": 3, "num_attention_heads": 4,
        "seq_length": 16, "num_experts": 4, "moe_router_topk": 2, "first_moe_layer": 1, "mtp_num_layers": 1}
DEMO_K, DEMO_MICRO_BATCH = 4, 2


def _demo_counts():
    """(useful, executed) FLOPs of one demo training step, from the sizes: per micro-batch the decoder sees
    T = b*s tokens, the MTP layer T' = b*(s-1); every count is forward FLOPs x3 (forward + two gradients)."""
    h, f, v, heads, experts, topk = (DEMO[k] for k in ("hidden_size", "ffn_hidden_size", "vocab_size",
                                                      "num_attention_heads", "num_experts", "moe_router_topk"))
    b, s = DEMO_MICRO_BATCH, DEMO["seq_length"]
    decoder = (s, DEMO["num_layers"], DEMO["num_layers"] - DEMO["first_moe_layer"])   # (seq, layers, MoE layers)
    mtp = (s - 1, 1, 1)
    expert_per_token = 2 * h * f + 2 * f * h
    executed = useful = 0
    for seq, layers, moe_layers in (decoder, mtp):
        tokens = b * seq
        projections = 2 * tokens * h * 3 * h + 2 * tokens * h * h
        # executed: per head (T x d)(d x T) scores and (T x T)(T x d) context over the flattened micro-batch
        attention_run = heads * 2 * (2 * tokens * tokens * (h // heads))
        # useful: per sequence the s(s+1)/2 query-key pairs of a causal mask, both matmuls, the full width
        attention_useful = 2 * 2 * b * (seq * (seq + 1) // 2) * h
        dense_mlp = (layers - moe_layers) * 2 * (2 * tokens * h * f)
        router = moe_layers * 2 * tokens * h * experts
        output_layer = 2 * tokens * h * v
        mtp_projection = 2 * tokens * 2 * h * h if seq == s - 1 else 0
        common = layers * projections + dense_mlp + router + output_layer + mtp_projection
        executed += common + layers * attention_run + moe_layers * experts * tokens * expert_per_token
        # each token is routed to topk distinct experts, none dropped
        useful += common + layers * attention_useful + moe_layers * topk * tokens * expert_per_token
    return 3 * DEMO_K * useful, 3 * DEMO_K * executed


def test_the_demo_model_declares_its_useful_flops(tmp_path):
    from tests.support.jsonl import read_jsonl
    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
    from mindmon.demo.model import DemoModelConfig, DemoMoEGPT

    model = DemoMoEGPT(DemoModelConfig.from_dict(DEMO))
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-3)
    group = build_group(parse_sections({"monitor": {
        "output_dir": str(tmp_path), "speed": {"enabled": True, "flops": True, "peak_tflops": 1.0},
        "moe_monitor": {"save_tokens_per_expert_interval": 1}}}), model=model)
    train_step = AccumulatingTrainStep(lambda ids, labels: model(ids, labels)[0], optimizer, DEMO_K, group=group)
    data = np.random.default_rng(5)
    group.setup()
    for step in (1, 2):
        ids = Tensor(data.integers(0, DEMO["vocab_size"], (DEMO_K * DEMO_MICRO_BATCH, DEMO["seq_length"])), ms.int32)
        labels = Tensor(data.integers(0, DEMO["vocab_size"], (DEMO_K * DEMO_MICRO_BATCH, DEMO["seq_length"])),
                        ms.int32)
        train_step(split_batch((ids, labels), DEMO_K))
        group.flush(step)
    group.close()
    useful, executed = _demo_counts()
    assert (useful, executed) == (40_445_952, 63_406_080)   # the figures docs/flops.md gives
    assert useful < executed    # all 4 experts run for the 2 chosen; attention over the whole micro-batch
    rows = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    for step in (1, 2):
        got = {r["name"]: r["value"] for r in rows if r["kind"] == "flops" and r["step"] == step}
        assert got == {"useful": useful, "executed": executed}
