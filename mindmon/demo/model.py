"""A tiny MoE GPT that runs on CPU and is shaped like a MindFormers model.

Parameter and cell names follow MindFormers/Megatron (`embedding.word_embeddings`,
`decoder.layers.<i>.self_attention.core_attention`, `decoder.layers.<i>.mlp`,
`mtp.layers.0.transformer_layer...`), so monitors find what they look for in a real model.
Only kernels that have CPU implementations in MindSpore 2.9 are used.

Example:
    model = DemoMoEGPT(DemoModelConfig(num_layers=2))
    model.set_train(True)
    (loss,) = model(input_ids, labels)
"""
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Dict, List

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops

from mindmon.compat import narrow, split

_MASKED = -1e9


@dataclass
class DemoModelConfig:
    """Sizes of the demo model. Layers before `first_moe_layer` are dense, the rest MoE."""

    vocab_size: int = 64
    hidden_size: int = 32
    ffn_hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    seq_length: int = 16
    num_experts: int = 4
    moe_router_topk: int = 2
    first_moe_layer: int = 1
    mtp_num_layers: int = 1
    mtp_loss_scale: float = 0.3
    aux_loss_coeff: float = 0.01
    init_std: float = 0.05
    seed: int = 1234

    @classmethod
    def from_dict(cls, values: dict) -> "DemoModelConfig":
        """Build from a mapping, ignoring keys that are not sizes of this model."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


def _init(rng, shape, std):
    return Tensor(rng.normal(0.0, std, size=shape).astype(np.float32))


class Linear(nn.Cell):
    """y = x W^T for x of shape (tokens, in); `weight` has the Megatron (out, in) layout.

    Only 2-D matmuls: batched matmul costs milliseconds per call on CPU MindSpore 2.9.
    """

    def __init__(self, in_size, out_size, rng, std):
        super().__init__()
        self.weight = Parameter(_init(rng, (out_size, in_size), std), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        return self.matmul(x, self.weight)


class LayerNorm(nn.Cell):
    """Layer norm written with CPU-safe reductions."""

    def __init__(self, size, eps=1e-5):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(size, np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(size, np.float32)), name="bias")
        self.eps = eps

    def construct(self, x):
        centered = x - mint.mean(x, dim=-1, keepdim=True)
        var = mint.mean(centered * centered, dim=-1, keepdim=True)
        return centered / mint.sqrt(var + self.eps) * self.weight + self.bias


class CoreAttention(nn.Cell):
    """Per head h: softmax(Q_h K_h^T / sqrt(d) + mask) V_h, with an optional running max of the logits.

    Tokens of all sequences are flattened to one axis and `mask` is block-diagonal causal, so one
    2-D matmul per head serves the whole micro-batch. The running max covers the unmasked positions
    of every micro-batch since the last `reset_max_attention_logit()`; it lives in the
    `max_logits_val` Parameter of shape (num_heads,).
    """

    def __init__(self, num_heads, head_dim):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = 1.0 / float(np.sqrt(head_dim))
        self.max_logits_val = Parameter(
            Tensor(np.full(num_heads, -np.inf, np.float32)), name="max_logits_val", requires_grad=False)
        self.track_max_attention_logit = False
        self.scores_matmul = ops.MatMul(transpose_b=True)
        self.context_matmul = ops.MatMul()

    def construct(self, q, k, v, mask):
        # mint.split, not tensor slicing: a slice waits for the async op queue on CPU.
        heads = zip(*(split(t, self.head_dim, dim=-1) for t in (q, k, v)))
        contexts, all_scores = [], []
        for q_h, k_h, v_h in heads:
            scores = self.scores_matmul(q_h, k_h) * self.scale + mask
            all_scores.append(scores)
            contexts.append(self.context_matmul(mint.softmax(scores, dim=-1), v_h))
        if self.track_max_attention_logit:
            self._track_max(all_scores)
        return mint.cat(contexts, dim=-1)

    def _track_max(self, all_scores):
        # One stack and one reduction for all heads: six kernel launches per layer, not two per head
        # plus three (PyNative cost is per launch on CPU, not per flop).
        stacked = ops.stop_gradient(ops.stack(all_scores)).reshape(self.num_heads, -1)
        ops.assign(self.max_logits_val, mint.maximum(self.max_logits_val, stacked.max(axis=-1)))

    def reset_max_attention_logit(self):
        ops.assign(self.max_logits_val, ops.full_like(self.max_logits_val, -np.inf))


class SelfAttention(nn.Cell):
    def __init__(self, cfg: DemoModelConfig, rng):
        super().__init__()
        h = cfg.hidden_size
        self.hidden_size = h
        self.linear_qkv = Linear(h, 3 * h, rng, cfg.init_std)
        self.core_attention = CoreAttention(cfg.num_attention_heads, h // cfg.num_attention_heads)
        self.linear_proj = Linear(h, h, rng, cfg.init_std)

    def construct(self, x, mask):
        q, k, v = split(self.linear_qkv(x), self.hidden_size, dim=-1)
        context = self.core_attention(q, k, v, mask)
        return self.linear_proj(context)


class MLP(nn.Cell):
    def __init__(self, hidden, ffn, rng, std):
        super().__init__()
        self.linear_fc1 = Linear(hidden, ffn, rng, std)
        self.linear_fc2 = Linear(ffn, hidden, rng, std)

    def construct(self, x):
        y = self.linear_fc1(x)
        return self.linear_fc2(y * mint.sigmoid(y))


class DenseMLP(MLP):
    """A dense feed-forward block; returns a zero auxiliary loss to match the MoE signature."""

    def construct(self, x):
        return super().construct(x), ops.zeros((), ms.float32)


class Router(nn.Cell):
    def __init__(self, cfg: DemoModelConfig, rng):
        super().__init__()
        self.weight = Parameter(_init(rng, (cfg.num_experts, cfg.hidden_size), cfg.init_std), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        return self.matmul(x, self.weight)


class Experts(nn.Cell):
    def __init__(self, cfg: DemoModelConfig, rng):
        super().__init__()
        self.local_experts = nn.CellList(
            [MLP(cfg.hidden_size, cfg.ffn_hidden_size, rng, cfg.init_std) for _ in range(cfg.num_experts)])

    def construct(self, tokens, expert_weights):
        out = ops.zeros_like(tokens)
        for expert, weight in zip(self.local_experts, split(expert_weights, 1, dim=1)):
            out = out + expert(tokens) * weight
        return out


class MoELayer(nn.Cell):
    """Top-k routed experts with a cumulative `tokens_per_expert` count (float, shape (num_experts,)).

    Every expert runs on every token and is weighted by its (zero when unselected) gate: exact
    top-k MoE maths with no scatter kernels, which CPU MindSpore lacks. The count grows by
    tokens x top-k per forward pass, as MindFormers' MoE layer counts it.
    """

    def __init__(self, cfg: DemoModelConfig, rng):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.topk = cfg.moe_router_topk
        self.aux_loss_coeff = cfg.aux_loss_coeff
        self.router = Router(cfg, rng)
        self.experts = Experts(cfg, rng)
        self.tokens_per_expert = Parameter(
            Tensor(np.zeros(cfg.num_experts, np.float32)), name="tokens_per_expert", requires_grad=False)

    def construct(self, tokens):
        probs = mint.softmax(self.router(tokens), dim=-1)
        top_probs, top_index = ops.topk(probs, self.topk)
        gates = top_probs / top_probs.sum(axis=-1, keepdims=True)
        chosen = ops.one_hot(top_index, self.num_experts, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        expert_weights = (chosen * gates.expand_dims(-1)).sum(axis=1)
        counts = ops.stop_gradient(chosen.sum(axis=(0, 1)))
        ops.assign_add(self.tokens_per_expert, counts)
        # Switch-style balance loss: num_experts * sum_e(fraction of routed slots_e * mean prob_e).
        fraction = counts / float(tokens.shape[0] * self.topk)
        aux_loss = self.aux_loss_coeff * self.num_experts * (fraction * probs.mean(axis=0)).sum()
        return self.experts(tokens, expert_weights), aux_loss


class TransformerLayer(nn.Cell):
    def __init__(self, cfg: DemoModelConfig, rng, moe: bool):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = LayerNorm(h)
        self.self_attention = SelfAttention(cfg, rng)
        self.pre_mlp_layernorm = LayerNorm(h)
        self.mlp = MoELayer(cfg, rng) if moe else DenseMLP(h, cfg.ffn_hidden_size, rng, cfg.init_std)

    def construct(self, x, mask):
        x = x + self.self_attention(self.input_layernorm(x), mask)
        mlp_out, aux_loss = self.mlp(self.pre_mlp_layernorm(x))
        return x + mlp_out, aux_loss


class TransformerBlock(nn.Cell):
    def __init__(self, cfg: DemoModelConfig, rng):
        super().__init__()
        self.layers = nn.CellList(
            [TransformerLayer(cfg, rng, moe=i >= cfg.first_moe_layer) for i in range(cfg.num_layers)])
        self.final_layernorm = LayerNorm(cfg.hidden_size)

    def construct(self, x, mask):
        aux_total = ops.zeros((), ms.float32)
        for layer in self.layers:
            x, aux_loss = layer(x, mask)
            aux_total = aux_total + aux_loss
        return x, self.final_layernorm(x), aux_total


class Embedding(nn.Cell):
    def __init__(self, cfg: DemoModelConfig, rng):
        super().__init__()
        self.word_embeddings = WordEmbedding(cfg, rng)

    def construct(self, input_ids):
        return self.word_embeddings(input_ids)


class WordEmbedding(nn.Cell):
    def __init__(self, cfg: DemoModelConfig, rng):
        super().__init__()
        self.weight = Parameter(_init(rng, (cfg.vocab_size, cfg.hidden_size), cfg.init_std), name="weight")

    def construct(self, input_ids):
        return ops.gather(self.weight, input_ids.reshape(-1), 0)


class MTPLayer(nn.Cell):
    """Predicts token t+2 from the decoder state at t and the embedding of token t+1 (DeepSeek-V3 MTP)."""

    def __init__(self, cfg: DemoModelConfig, rng):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = LayerNorm(h)
        self.hnorm = LayerNorm(h)
        self.eh_proj = Linear(2 * h, h, rng, cfg.init_std)
        self.transformer_layer = TransformerLayer(cfg, rng, moe=True)
        self.final_layernorm = LayerNorm(h)

    def construct(self, hidden, next_embeddings, mask):
        x = self.eh_proj(mint.cat((self.enorm(next_embeddings), self.hnorm(hidden)), dim=-1))
        x, aux_loss = self.transformer_layer(x, mask)
        return self.final_layernorm(x), aux_loss


class MultiTokenPrediction(nn.Cell):
    def __init__(self, cfg: DemoModelConfig, rng):
        super().__init__()
        self.layers = nn.CellList([MTPLayer(cfg, rng) for _ in range(cfg.mtp_num_layers)])


def _log_softmax_nll(logits, labels, vocab_size):
    """Mean negative log-likelihood; log-softmax by hand (the CPU LogSoftmax kernel is slow)."""
    shifted = logits - ops.stop_gradient(mint.max(logits, dim=-1, keepdim=True)[0])
    log_probs = shifted - mint.log(mint.sum(mint.exp(shifted), dim=-1, keepdim=True))
    one_hot = ops.one_hot(labels, vocab_size, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
    return -(log_probs * one_hot).sum(axis=-1).mean()


class DemoMoEGPT(nn.Cell):
    """The demo model: `construct(input_ids, labels)` returns `(loss,)`.

    loss = next-token cross entropy + mtp_loss_scale x MTP cross entropy + router balance losses
    (`get_loss_components()`: each part by name).
    Max-logit tracking is off until `track_max_attention_logit = True`.

    Example:
        model = DemoMoEGPT(DemoModelConfig())
        model.track_max_attention_logit = True
        (loss,) = model(input_ids, labels)
        model.get_max_attention_logit()  # {"decoder.layers.0...max_logits_val": Tensor[num_heads]}
    """

    def __init__(self, config: DemoModelConfig = None):
        super().__init__()
        cfg = config or DemoModelConfig()
        self.config = cfg
        rng = np.random.default_rng(cfg.seed)
        self.embedding = Embedding(cfg, rng)
        self.decoder = TransformerBlock(cfg, rng)
        self.output_layer = Linear(cfg.hidden_size, cfg.vocab_size, rng, cfg.init_std)
        self.mtp = MultiTokenPrediction(cfg, rng) if cfg.mtp_num_layers > 0 else None
        self._masks = {}
        self._mask_shapes = {}   # id of a cached mask: the (batch, seq) it was built for
        self._track = False

    @property
    def track_max_attention_logit(self) -> bool:
        return self._track

    @track_max_attention_logit.setter
    def track_max_attention_logit(self, value: bool):
        self._track = bool(value)
        for cell in self._core_attentions():
            cell.track_max_attention_logit = self._track

    def construct(self, input_ids, labels):
        batch, seq = input_ids.shape
        hidden, normed, aux_loss = self.decoder(self.embedding(input_ids), self._mask(batch, seq))
        lm_loss = _log_softmax_nll(self.output_layer(normed), labels.reshape(-1), self.config.vocab_size)
        loss = lm_loss + aux_loss
        parts = {"lm loss": lm_loss, "load_balancing_loss": aux_loss}
        if self.mtp is not None:
            loss = loss + self._mtp_loss(hidden, input_ids, labels, parts)
        self._loss_components = {name: ops.stop_gradient(part) for name, part in parts.items()}
        return (loss,)

    def _mtp_loss(self, hidden, input_ids, labels, parts):
        """The MTP loss; `parts` gets `mtp_<d> loss` (depth d's cross entropy) and the MTP routers' balance
        losses on `load_balancing_loss`, each weighted by mtp_loss_scale / depths as the loss counts them."""
        batch, seq = input_ids.shape
        total = ops.zeros((), ms.float32)
        weight = self.config.mtp_loss_scale / len(self.mtp.layers)
        for depth, layer in enumerate(self.mtp.layers, start=1):
            # Depth d predicts token t+1+d from the state at t and the embedding of token t+d.
            length = seq - depth
            hidden = narrow(hidden.reshape(batch, length + 1, -1), 1, 0, length).reshape(batch * length, -1)
            next_embeddings = self.embedding(narrow(input_ids, 1, depth, length))
            hidden, aux_loss = layer(hidden, next_embeddings, self._mask(batch, length))
            depth_labels = narrow(labels, 1, depth, length).reshape(-1)
            cross_entropy = _log_softmax_nll(self.output_layer(hidden), depth_labels, self.config.vocab_size)
            total = total + cross_entropy
            total = total + aux_loss
            parts[f"mtp_{depth} loss"] = weight * cross_entropy
            parts["load_balancing_loss"] = parts["load_balancing_loss"] + weight * aux_loss
        return self.config.mtp_loss_scale * total / len(self.mtp.layers)

    def init_states(self):
        """The constructor's values again, from the same seed: MindFormers 2.x's Trainer gives every parameter
        fresh, uninitialized storage (`to_empty()`) and then asks the model to fill it."""
        fresh = DemoMoEGPT(self.config)
        for (name, parameter), (_, value) in zip(self.parameters_and_names(), fresh.parameters_and_names()):
            parameter.set_data(value.data)

    def get_loss_components(self) -> Dict[str, Tensor]:
        """The parts of the last forward's loss, which add up to it: `lm loss` (next-token cross entropy),
        `load_balancing_loss` (every router's balance loss, the MTP layers' weighted as the MTP loss),
        `mtp_<d> loss` (depth d's cross entropy x mtp_loss_scale / depths). Megatron's names."""
        return dict(getattr(self, "_loss_components", {}))

    def _mask(self, batch: int, seq: int) -> Tensor:
        """Block-diagonal causal mask over the flattened (batch * seq) tokens, built once per shape."""
        key = (batch, seq)
        if key not in self._masks:
            causal = np.triu(np.ones((seq, seq), bool), k=1)
            blocked = ~np.kron(np.eye(batch, dtype=bool), ~causal)
            self._masks[key] = Tensor(np.where(blocked, _MASKED, 0.0).astype(np.float32))
            self._mask_shapes[id(self._masks[key])] = key
        return self._masks[key]

    def flop_counting(self) -> dict:
        """The useful work a FLOP counter (`monitor.speed.flops`) cannot read from the shapes: this model runs
        every expert on every token and attention over the whole flattened micro-batch, but its useful work is
        each token through the experts it was routed to (the layers' `tokens_per_expert`, as mindmon's MoE
        monitor reads them) and causal attention within each sequence (docs/flops.md, "The demo model")."""
        from mindmon.features.speed.flops import AttentionSpec, ExpertSpec

        return {"attention": AttentionSpec(r"core_attention$", layout="TH", causal=True,
                                           sequence_lengths=self._sequence_lengths),
                "experts": ExpertSpec(r"^(?P<layer>.*\.mlp)\.experts\.local_experts\.(?P<expert>\d+)$")}

    def _sequence_lengths(self, cell, inputs) -> List[int]:
        """A core attention call's sequences: its mask (input 3) says which (batch, seq) it serves; no padding."""
        batch, seq = self._mask_shapes[id(inputs[3])]
        return [seq] * batch

    def _core_attentions(self) -> List[CoreAttention]:
        return [cell for _, cell in self.cells_and_names() if isinstance(cell, CoreAttention)]

    def get_max_attention_logit(self) -> Dict[str, Tensor]:
        """Running max of QK^T/sqrt(d) per head since the last reset, keyed by Parameter name."""
        return {cell.max_logits_val.name: cell.max_logits_val for cell in self._core_attentions()}

    def reset_max_attention_logit(self):
        for cell in self._core_attentions():
            cell.reset_max_attention_logit()

    def get_gpt_transformer_config(self):
        """The attributes MindFormers' LossCallback reads to estimate FLOPs."""
        cfg = self.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        moe_pattern = [int(i >= cfg.first_moe_layer) for i in range(cfg.num_layers)]
        return SimpleNamespace(
            seq_length=cfg.seq_length, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_attention_heads,
            kv_channels=head_dim, ffn_hidden_size=cfg.ffn_hidden_size, vocab_size=cfg.vocab_size,
            num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.ffn_hidden_size, moe_layer_freq=moe_pattern,
            moe_shared_expert_intermediate_size=None, mtp_num_layers=cfg.mtp_num_layers,
            multi_latent_attention=False, hidden_act="gelu", q_lora_rank=None, kv_lora_rank=None,
            qk_head_dim=head_dim, qk_pos_emb_head_dim=0, v_head_dim=head_dim)
