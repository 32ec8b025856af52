"""Tokens per expert on real HuggingFace MoE models run by mindnlp, random weights, through the plain loop:
Qwen2-MoE (a Linear gate; the MoE block takes the top-k of its softmax), DeepSeek-V3 (its router returns
the chosen expert ids itself, after sigmoid + correction bias + group-limited selection), GPT-OSS (its
router returns (scores, indices)) and Switch
Transformers (a top-1 router whose capacity limit drops tokens). Every count is
compared with the router's own choice, captured by a second forward hook on the same gate that computes
nothing of mindmon's (numpy over the gate's own output).

Runs in the MindSpore 2.7 environment (`make test-ms27`), in its own pytest process: `import mindnlp`
changes `mindspore.Tensor` for the whole process.
"""
import logging
import re
from collections import defaultdict

import numpy as np
import pytest

from tests.support.jsonl import read_jsonl

pytestmark = [pytest.mark.ms27, pytest.mark.mindnlp]

K, STEPS, BATCH, SEQ, VOCAB = 2, 2, 4, 8, 64


class SGD:
    """AccumulatingTrainStep's optimizer contract (mindnlp 0.5.1's optimizers have no CPU kernels)."""

    def __init__(self, parameters, lr):
        self.parameters, self.lr = tuple(parameters), lr

    def __call__(self, grads):
        for parameter, grad in zip(self.parameters, grads):
            parameter.copy_(parameter - self.lr * grad)


@pytest.fixture(scope="module")
def mindnlp_transformers():
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    import mindnlp  # noqa: F401
    from mindnlp import transformers

    return transformers


def qwen2_moe(transformers):
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32)
    return transformers.Qwen2MoeForCausalLM(config), 4, 2


def deepseek_v3(transformers):
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=32, attn_implementation="eager")
    model = transformers.DeepseekV3ForCausalLM(config)
    import mindspore as ms

    rng = np.random.default_rng(3)   # a correction bias that changes the choice (it starts at zero)
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.e_score_correction_bias.copy_(ms.Tensor(rng.normal(0, 0.5, 8).astype(np.float32)))
    return model, 8, 2


def capture_choices(model, choose, gate="mlp.gate"):
    """Per gate call, in order: (layer id, numpy count per expert of what `choose(output)` says the router
    chose). A hook of the test's own, on the same gates (the cells whose name ends with `gate`)."""
    calls = []

    def hook(layer):
        def on_forward(module, inputs, output):
            chosen = choose(output)
            calls.append((layer, np.bincount(chosen.ravel(), minlength=NUM[0])))
        return on_forward

    for name, module in model.named_modules():
        if name.endswith(gate):
            module.register_forward_hook(hook(int(re.search(r"layers\.(\d+)", name).group(1))))
    return calls


NUM = [0]


def train(model, tmp_path, caplog):
    import mindspore as ms

    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
    from mindmon import parameter_names

    optimizer = SGD(model.parameters(), 0.1)
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path),
                                                    "moe_monitor": {"save_tokens_per_expert_interval": 1}}}),
                        model=model, parameter_names=parameter_names(model, optimizer))
    step_fn = AccumulatingTrainStep(lambda ids: model(input_ids=ids, labels=ids).loss, optimizer, K, group)
    batches = np.random.default_rng(5).integers(0, VOCAB, (STEPS, BATCH, SEQ)).astype(np.int64)
    group.setup(max_steps=STEPS)
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        for step, batch in enumerate(batches, start=1):
            step_fn(split_batch((ms.Tensor(batch),), K))
            group.flush(step)
    group.close()
    return {(r["step"], r["micro_step"], r["name"]): r["value"]
            for r in read_jsonl(tmp_path / "rank_0" / "metrics.jsonl") if r["kind"] == "tokens_per_expert"}


def expected(calls, layers):
    """{(step, micro_step, decoder.layers.<L>): count}: the i-th call of a layer's gate is micro-batch i."""
    seen, out = defaultdict(int), {}
    for layer, counts in calls:
        index = seen[layer]
        seen[layer] += 1
        out[(index // K + 1, index % K, f"decoder.layers.{layer}")] = [int(c) for c in counts]
    assert len(out) == STEPS * K * layers
    return out


def test_qwen2_moe_softmax_topk_over_a_linear_gate(mindnlp_transformers, tmp_path, caplog):
    from mindmon.probes import attach_tokens_per_expert_probes

    model, experts, topk = qwen2_moe(mindnlp_transformers)
    NUM[0] = experts
    attach_tokens_per_expert_probes(model, r"mlp\.gate$", num_experts=experts, topk=topk)
    # The router's own rule (the MoE block): top-k of softmax(logits), taken here in numpy.
    calls = capture_choices(model, lambda logits: np.argsort(-logits.asnumpy(), axis=1, kind="stable")[:, :topk])
    got = train(model, tmp_path, caplog)
    want = expected(calls, 2)
    assert got == want
    assert all(sum(v) == BATCH // K * SEQ * topk for v in got.values())
    assert not [r for r in caplog.records if "probe" in r.getMessage()]


def test_deepseek_v3_router_that_returns_its_indices(mindnlp_transformers, tmp_path, caplog):
    from mindmon.probes import attach_tokens_per_expert_probes

    model, experts, topk = deepseek_v3(mindnlp_transformers)
    NUM[0] = experts
    attach_tokens_per_expert_probes(model, r"mlp\.gate$", num_experts=experts, topk=topk, output_index=0,
                                    selection="indices")
    calls = capture_choices(model, lambda output: output[0].asnumpy())   # (topk_indices, topk_weights)
    got = train(model, tmp_path, caplog)
    assert got == expected(calls, 2)
    assert not [r for r in caplog.records if "probe" in r.getMessage()]


def gpt_oss(transformers):
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        sliding_window=4, attn_implementation="eager")
    return transformers.GptOssForCausalLM(config), 4, 2


def test_gpt_oss_router_whose_second_output_holds_the_indices(mindnlp_transformers, tmp_path, caplog):
    """GPT-OSS's GptOssTopKRouter returns (router_scores, router_indices); the experts take the indices."""
    from mindmon.probes import attach_tokens_per_expert_probes

    model, experts, topk = gpt_oss(mindnlp_transformers)
    NUM[0] = experts
    attach_tokens_per_expert_probes(model, r"mlp\.router$", num_experts=experts, topk=topk, output_index=1,
                                    selection="indices")
    calls = capture_choices(model, lambda output: output[1].asnumpy(), gate="mlp.router")
    got = train(model, tmp_path, caplog)
    want = expected(calls, 2)
    assert got == want
    assert all(sum(v) == BATCH // K * SEQ * topk for v in got.values())
    assert len({tuple(v) for v in got.values()}) > 1   # random weights: the choice differs between calls
    assert not [r for r in caplog.records if "probe" in r.getMessage()]


def test_switch_transformers_capacity_drops_are_counted_apart(mindnlp_transformers, tmp_path, caplog):
    """Switch Transformers' top-1 router with an expert capacity of 3 tokens per sequence: its dispatch mask
    (output 0) holds the kept tokens. Expected from its logits (output 2), in numpy: each token's argmax
    expert, kept while that expert has taken fewer than 3 tokens of the sequence."""
    import mindspore as ms

    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
    from mindmon.probes import attach_tokens_per_expert_probes

    experts, capacity = 4, 3
    config = mindnlp_transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, expert_capacity=capacity, num_layers=2,
        num_sparse_encoder_layers=2, num_decoder_layers=2, num_sparse_decoder_layers=2, num_heads=2,
        num_experts=experts, decoder_start_token_id=0, pad_token_id=0)
    model = mindnlp_transformers.SwitchTransformersForConditionalGeneration(config)
    routers = r"encoder\.block\.\d+\.layer\.\d+\.mlp\.router$"
    attach_tokens_per_expert_probes(model, routers, num_experts=experts, topk=1, output_index=0, selection="mask")
    calls = []

    def own_choice(module, inputs, output):
        chosen = output[2].asnumpy().argmax(-1)                            # (sequences, tokens)
        kept = np.zeros(experts, np.int64)
        for row in chosen:
            taken = np.zeros(experts, np.int64)
            for expert in row:
                taken[expert] += 1
                kept[expert] += taken[expert] <= capacity
        calls.append((module.layer_id, kept, chosen.size - kept.sum()))

    for name, module in model.named_modules():
        if re.search(routers, name):
            module.layer_id = int(re.search(r"block\.(\d+)", name).group(1))
            module.register_forward_hook(own_choice)
    optimizer = SGD(model.parameters(), 0.1)
    group = build_group(parse_sections({"monitor": {
        "output_dir": str(tmp_path), "moe_monitor": {"save_tokens_per_expert_interval": 1,
                                                     "layer_pattern": r"^encoder\.block\.(\d+)\."}}}), model=model)
    step_fn = AccumulatingTrainStep(lambda ids: model(input_ids=ids, labels=ids).loss, optimizer, K, group)
    batches = np.random.default_rng(5).integers(1, VOCAB, (STEPS, BATCH, SEQ)).astype(np.int64)
    group.setup()
    for step, batch in enumerate(batches, start=1):
        step_fn(split_batch((ms.Tensor(batch),), K))
        group.flush(step)
    group.close()
    rows = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    got = {(r["step"], r["micro_step"], r["name"]): r["value"] for r in rows if r["kind"] == "tokens_per_expert"}
    want, dropped, seen = {}, defaultdict(int), defaultdict(int)
    for layer, kept, lost in calls:
        index = seen[layer]
        seen[layer] += 1
        want[(index // K + 1, index % K, f"decoder.layers.{layer}")] = [int(c) for c in kept]
        dropped[(index // K + 1, f"decoder.layers.{layer}")] += int(lost)
    assert got == want and len(want) == STEPS * K * 2
    got_dropped = {(r["step"], r["name"]): r["value"] for r in rows if r["kind"] == "moe_dropped_tokens"}
    assert got_dropped == dropped and sum(dropped.values()) > 0   # the capacity did drop tokens
    assert not [r for r in caplog.records if "probe" in r.getMessage()]


def test_a_probe_that_cannot_read_the_output_detaches_and_training_goes_on(mindnlp_transformers, tmp_path, caplog):
    from mindmon.probes import attach_tokens_per_expert_probes

    model, experts, topk = qwen2_moe(mindnlp_transformers)
    # Wrong on purpose: the gate returns one (tokens, experts) tensor, not a tuple whose item 99 holds the scores.
    probes = attach_tokens_per_expert_probes(model, r"mlp\.gate$", num_experts=experts, topk=topk, output_index=99)
    train(model, tmp_path, caplog)
    lines = [r.getMessage() for r in caplog.records if "tokens-per-expert probe" in r.getMessage()]
    assert len(lines) == 2 and all("detached and training goes on" in line for line in lines)   # one per gate
    assert probes.handles == []
