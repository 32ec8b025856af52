"""Megatron-style model parallelism built by hand in MindSpore (PyNative, CPU collectives over mccl), for
the model-parallel tests: tensor-parallel copy/reduce Cells with custom backward passes around column- and
row-parallel matmuls, a transformer block whose heads are split over the tensor-parallel ranks, and a
two-stage pipeline passing activations forward and their gradients back with all-reduces (MindSpore's
CPU Send/Receive do not run). The unsharded reference is tests/support/parallel_reference.py.
"""
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops

from tests.support import parallel_reference as ref


class CopyToTensorParallel(nn.Cell):
    """Forward: identity; backward: the gradient summed over the group (Megatron's f)."""

    def __init__(self, group):
        super().__init__()
        self.reduce = ops.AllReduce(group=group) if group else None

    def construct(self, x):
        return x * 1.0

    def bprop(self, x, out, dout):
        return (self.reduce(dout) if self.reduce is not None else dout,)


class ReduceFromTensorParallel(nn.Cell):
    """Forward: the partial results summed over the group; backward: identity (Megatron's g)."""

    def __init__(self, group):
        super().__init__()
        self.reduce = ops.AllReduce(group=group) if group else None

    def construct(self, x):
        return self.reduce(x) if self.reduce is not None else x * 1.0

    def bprop(self, x, out, dout):
        return (dout,)


def _parameter(name, full, dim, index, parts):
    value = ref.shard(full, dim, index, parts).astype(np.float32)
    parameter = Parameter(Tensor(value), name=name)
    if dim is not None:   # Megatron's attributes, which mindmon's layout reads
        parameter.tensor_model_parallel = True
        parameter.partition_dim = dim
    return parameter


class TensorParallelBlock(nn.Cell):
    """This rank's part of the block: heads [t * HEADS / tp, (t + 1) * HEADS / tp), fc1 columns and fc2 rows
    likewise. `get_max_attention_logit()` gives this rank's heads' running max (the model-side counter
    mindmon reads)."""

    def __init__(self, full: dict, group, index: int, parts: int):
        super().__init__()
        self.heads = ref.HEADS // parts
        self.params = {}
        for name, value in full.items():
            parameter = _parameter(name, value, ref.TP_SPLIT.get(name), index, parts)
            self.params[name] = parameter
            setattr(self, name.replace(".", "_"), parameter)
        self.copy_attn, self.copy_mlp = CopyToTensorParallel(group), CopyToTensorParallel(group)
        self.reduce_attn, self.reduce_mlp = ReduceFromTensorParallel(group), ReduceFromTensorParallel(group)
        self.reset_max_attention_logit()

    def get_max_attention_logit(self):
        return {"block.attn": Tensor(self._max_logits.astype(np.float32))}

    def reset_max_attention_logit(self):
        self._max_logits = np.full(self.heads, -np.inf)

    def _layer_norm(self, x, prefix):
        mean = x.mean(-1, keep_dims=True)
        var = ((x - mean) ** 2).mean(-1, keep_dims=True)
        return (x - mean) / ops.sqrt(var + ref.EPS) * self.params[prefix + ".gamma"] + self.params[prefix + ".beta"]

    def _attention(self, x):
        p, (b, s) = self.params, x.shape[:2]
        h = self.copy_attn(self._layer_norm(x, "block.ln1"))
        qkv = (mint.matmul(h, p["block.attn.qkv.weight"]) + p["block.attn.qkv.bias"]).reshape(b, s, self.heads, 3, ref.D)
        q, k, v = qkv[:, :, :, 0, :], qkv[:, :, :, 1, :], qkv[:, :, :, 2, :]
        scores = mint.matmul(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1)) / float(np.sqrt(ref.D))
        self._max_logits = np.maximum(self._max_logits, scores.asnumpy().max(axis=(0, 2, 3)))
        attn = mint.matmul(ops.softmax(scores, -1), v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        out = self.reduce_attn(mint.matmul(attn.reshape(b, s, self.heads * ref.D), p["block.attn.proj.weight"]))
        return x + out + p["block.attn.proj.bias"]

    def construct(self, x, target):
        p = self.params
        x1 = self._attention(x)
        h2 = self.copy_mlp(self._layer_norm(x1, "block.ln2"))
        hidden = ops.relu(mint.matmul(h2, p["block.mlp.fc1.weight"]) + p["block.mlp.fc1.bias"])
        y = x1 + self.reduce_mlp(mint.matmul(hidden, p["block.mlp.fc2.weight"])) + p["block.mlp.fc2.bias"]
        return ((y - target) ** 2).mean()


class PipelineExchange(nn.Cell):
    """Stage 0's activation to stage 1 and stage 1's gradient of it back, as one all-reduce each way over
    the pipeline group: the rank that does not send contributes zeros."""

    def __init__(self, group):
        super().__init__()
        self.reduce = ops.AllReduce(group=group)

    def construct(self, x):
        return self.reduce(x)

    def bprop(self, x, out, dout):
        return (self.reduce(dout),)


class PipelineStage(nn.Cell):
    """One stage of the two-stage pipeline: stage 0 computes h and sends it (its "loss" is 0: the loss is
    the last stage's); stage 1 receives h and computes the loss."""

    def __init__(self, full: dict, stage: int, group):
        super().__init__()
        self.stage = stage
        self.weight = Parameter(Tensor(full[f"stage{stage}.weight"].astype(np.float32)), name=f"stage{stage}.weight")
        self.bias = Parameter(Tensor(full[f"stage{stage}.bias"].astype(np.float32)), name=f"stage{stage}.bias")
        self.exchange = PipelineExchange(group)

    def construct(self, x, target):
        if self.stage == 0:
            h = ops.tanh(mint.matmul(x, self.weight) + self.bias)
            return (self.exchange(h) * 0.0).sum()
        # The received activation must depend on a parameter, or the backward exchange would not run here.
        zeros = ops.zeros((x.shape[0], x.shape[1], ref.PIPE_HIDDEN), ms.float32) + 0.0 * self.bias.sum()
        y = mint.matmul(self.exchange(zeros), self.weight) + self.bias
        loss = ((y - target) ** 2).mean()
        self._parts = {"mse": ops.stop_gradient(loss)}
        return loss

    def get_loss_components(self):
        """The loss's one part, on the last stage only (the first stage computes no loss: none)."""
        return dict(getattr(self, "_parts", {}))


class ExpertParallelRouter(nn.Cell):
    """A top-1 router (replicated) whose experts are placed over the expert-parallel ranks: every rank routes
    its tokens, the counts reach the experts' ranks (an all-reduce over the group stands for the dispatch),
    and `tokens_per_expert` counts the tokens this rank's experts received, cumulatively (MindFormers'
    counter). Its loss, mean((x W)^2), trains the router."""

    def __init__(self, weight, group, index: int):
        super().__init__()
        self.weight = Parameter(Tensor(weight.astype(np.float32)), name="router.weight")
        self.local = ref.EXPERTS // ref.EP
        self.start = index * self.local
        self.tokens_per_expert = Parameter(Tensor(np.zeros(self.local, np.float32)), name="tokens_per_expert",
                                           requires_grad=False)
        self.reduce = ops.AllReduce(group=group)

    def construct(self, x):
        logits = mint.matmul(x, self.weight)
        choice = ops.stop_gradient(logits).asnumpy().argmax(-1).reshape(-1)
        mine = np.bincount(choice, minlength=ref.EXPERTS).astype(np.float32)
        received = self.reduce(Tensor(mine)).asnumpy()[self.start:self.start + self.local]
        ops.assign_add(self.tokens_per_expert, Tensor(received))
        return (logits ** 2).mean()


class _Layer(nn.Cell):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp


class _Decoder(nn.Cell):
    def __init__(self, mlp):
        super().__init__()
        self.layers = nn.CellList([_Layer(mlp)])


class MoENet(nn.Cell):
    """`decoder.layers.0.mlp` is the router, named as mindmon's MoE monitor finds MoE layers."""

    def __init__(self, router):
        super().__init__()
        self.decoder = _Decoder(router)

    def construct(self, x):
        return self.decoder.layers[0].mlp(x)


class _VirtualLayer(nn.Cell):
    """Layer v of the virtual pipeline: x W + b, then tanh but on the last layer."""

    def __init__(self, weight, bias, last: bool):
        super().__init__()
        self.weight = Parameter(Tensor(weight.astype(np.float32)))
        self.bias = Parameter(Tensor(bias.astype(np.float32)))
        self.last = last

    def construct(self, x):
        y = mint.matmul(x, self.weight) + self.bias
        return y if self.last else ops.tanh(y)


class VirtualChunk(nn.Cell):
    """Model chunk c of pipeline stage s (Megatron's VPP): it holds layer v = c x PP + s, as `layers.0`, the
    same names in every chunk (a chunk is the model's class, as in Megatron)."""

    def __init__(self, full: dict, chunk: int, stage: int):
        super().__init__()
        layer = chunk * ref.PP + stage
        self.layers = nn.CellList([_VirtualLayer(full[f"layer{layer}.weight"], full[f"layer{layer}.bias"],
                                                 layer == ref.VPP_LAYERS - 1)])
        for parameter in self.trainable_params():   # unique in the optimizer; the model's names stay layers.0.*
            parameter.name = f"chunk{chunk}.{parameter.name}"

    def construct(self, x):
        return self.layers[0](x)


class VirtualPipeline(nn.Cell):
    """Runs a micro-batch through the virtual stages in order (chunk 0 of stage 0, of stage 1, chunk 1 of
    stage 0, of stage 1): the stage owning a layer runs its chunk, the other adds zeros, and one exchange
    per layer hands the activation to every stage (its backward hands the gradient back). The loss is the
    last stage's; the other stage's is 0 (so its backward starts from the exchanged gradients only)."""

    def __init__(self, chunks, stage: int, group):
        super().__init__()
        self.chunks = nn.CellList(chunks)
        self.stage = stage
        self.exchanges = nn.CellList([PipelineExchange(group) for _ in range(ref.VPP_LAYERS)])

    def construct(self, x, target):
        for layer in range(ref.VPP_LAYERS):
            chunk, owner = divmod(layer, ref.PP)
            if owner == self.stage:
                x = self.chunks[chunk](x)
            else:   # depends on the input and this stage's parameters: every exchange's backward runs on both stages
                width = ref.vpp_width(layer + 1)
                x = ops.zeros((x.shape[0], x.shape[1], width), ms.float32) + 0.0 * x.sum() \
                    + 0.0 * self.chunks[0].layers[0].bias.sum()
            x = self.exchanges[layer](x)
        loss = ((x - target) ** 2).mean()
        return loss if self.stage == ref.PP - 1 else loss * 0.0
