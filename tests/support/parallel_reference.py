"""The unsharded models of the model-parallel tests in numpy float64, and their gradients by central
differences (no code shared with the MindSpore models of tests/support/parallel_model.py): the reference every
number a model-parallel run reports is checked against.

TP block (pre-LN, Megatron's split): y = x1 + relu(LN2(x1) W1 + b1) W2 + b2, x1 = x + attn(LN1(x)) Wo + bo,
attention over `HEADS` heads whose q/k/v columns lie per head ([q_h | k_h | v_h] blocks of 3 D), loss =
mean((y - target)^2). Pipeline: stage 0 h = tanh(x W0 + b0), stage 1 y = h W1 + b1, the same loss.
"""
import numpy as np

H, HEADS, D, F, S = 8, 4, 2, 16, 3   # hidden, heads, head dim (H = HEADS x D), MLP width, sequence
PIPE_IN, PIPE_HIDDEN, PIPE_OUT = 6, 5, 4
EPS = 1e-5


def tp_parameters(seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    return {"block.ln1.gamma": 1 + 0.1 * rng.standard_normal(H), "block.ln1.beta": 0.1 * rng.standard_normal(H),
            "block.attn.qkv.weight": 0.4 * rng.standard_normal((H, 3 * H)),
            "block.attn.qkv.bias": 0.1 * rng.standard_normal(3 * H),
            "block.attn.proj.weight": 0.4 * rng.standard_normal((H, H)), "block.attn.proj.bias": 0.1 * rng.standard_normal(H),
            "block.ln2.gamma": 1 + 0.1 * rng.standard_normal(H), "block.ln2.beta": 0.1 * rng.standard_normal(H),
            "block.mlp.fc1.weight": 0.4 * rng.standard_normal((H, F)), "block.mlp.fc1.bias": 0.1 * rng.standard_normal(F),
            "block.mlp.fc2.weight": 0.3 * rng.standard_normal((F, H)), "block.mlp.fc2.bias": 0.1 * rng.standard_normal(H)}


# (name -> dim split over tp) in the layout of the tests' models: column-parallel q/k/v and fc1, row-parallel
# proj and fc2; layer norms and the row-parallel biases replicated.
TP_SPLIT = {"block.attn.qkv.weight": 1, "block.attn.qkv.bias": 0, "block.attn.proj.weight": 0,
            "block.mlp.fc1.weight": 1, "block.mlp.fc1.bias": 0, "block.mlp.fc2.weight": 0}


def shard(full: np.ndarray, dim, index: int, parts: int) -> np.ndarray:
    if dim is None:
        return full
    return np.split(full, parts, axis=dim)[index]


def pipe_parameters(seed: int = 5) -> dict:
    rng = np.random.default_rng(seed)
    return {"stage0.weight": 0.5 * rng.standard_normal((PIPE_IN, PIPE_HIDDEN)),
            "stage0.bias": 0.1 * rng.standard_normal(PIPE_HIDDEN),
            "stage1.weight": 0.5 * rng.standard_normal((PIPE_HIDDEN, PIPE_OUT)),
            "stage1.bias": 0.1 * rng.standard_normal(PIPE_OUT)}


PIPE_STAGE = {"stage0.weight": 0, "stage0.bias": 0, "stage1.weight": 1, "stage1.bias": 1}


def batches(seed: int, steps: int, rows: int, width_in: int, width_out: int, seq: int = S):
    """`steps` global batches of (x, target), `rows` sequences each."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((rows, seq, width_in)), rng.standard_normal((rows, seq, width_out)))
            for _ in range(steps)]


def _layer_norm(x, gamma, beta):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * gamma + beta


def tp_forward(p: dict, x: np.ndarray, target: np.ndarray):
    """(loss, per-head max of q.k/sqrt(D) over the batch)."""
    h = _layer_norm(x, p["block.ln1.gamma"], p["block.ln1.beta"])
    qkv = (h @ p["block.attn.qkv.weight"] + p["block.attn.qkv.bias"]).reshape(*x.shape[:2], HEADS, 3, D)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attn = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(*x.shape[:2], H)
    x1 = x + attn @ p["block.attn.proj.weight"] + p["block.attn.proj.bias"]
    h2 = _layer_norm(x1, p["block.ln2.gamma"], p["block.ln2.beta"])
    y = x1 + np.maximum(h2 @ p["block.mlp.fc1.weight"] + p["block.mlp.fc1.bias"], 0) @ p["block.mlp.fc2.weight"] \
        + p["block.mlp.fc2.bias"]
    return float(np.mean((y - target) ** 2)), scores.max(axis=(0, 2, 3))


def pipe_forward(p: dict, x: np.ndarray, target: np.ndarray):
    h = np.tanh(x @ p["stage0.weight"] + p["stage0.bias"])
    y = h @ p["stage1.weight"] + p["stage1.bias"]
    return float(np.mean((y - target) ** 2)), None


def gradients(forward, p: dict, x, target, step: float = 1e-6) -> dict:
    """d loss / d p for every parameter, by central differences in float64."""
    grads = {}
    for name, value in p.items():
        grad = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            saved = value[index]
            value[index] = saved + step
            up = forward(p, x, target)[0]
            value[index] = saved - step
            down = forward(p, x, target)[0]
            value[index] = saved
            grad[index] = (up - down) / (2 * step)
        grads[name] = grad
    return grads


def train(forward, params: dict, steps, dp: int, k: int, lr: float, max_norm: float):
    """Data parallel over `dp` replicas, K micro-batches each, SGD with global-norm clipping, as
    AccumulatingTrainStep does. Returns per step a dict: losses[d][k], accumulated-norm history
    norms[d][k][name] (|G_k| of replica d), micro[d][k][name], device[name] (of the dp mean), grad_norm,
    device_loss, max_logits (per head, max over replicas and micro-batches), mean_grad[name] (the dp mean of
    the accumulated gradients), accumulated[d][name] (replica d's mean over its micro-batches), and the parameters before (params_before) and after (params)."""
    p = {n: v.copy() for n, v in params.items()}
    history = []
    for x, target in steps:
        rows = x.shape[0] // (dp * k)
        out = {"losses": [], "norms": [], "micro": [], "max_logits": None, "accumulated": []}
        mean = {n: np.zeros_like(v) for n, v in p.items()}
        for d in range(dp):
            accumulated = {n: np.zeros_like(v) for n, v in p.items()}
            losses, norms, micros = [], [], []
            for j in range(k):
                start = (d * k + j) * rows
                xb, tb = x[start:start + rows], target[start:start + rows]
                loss, logits = forward(p, xb, tb)
                if logits is not None:
                    out["max_logits"] = logits if out["max_logits"] is None else np.maximum(out["max_logits"], logits)
                grads = gradients(forward, p, xb, tb)
                losses.append(loss)
                micros.append({n: float(np.linalg.norm(g / k)) for n, g in grads.items()})
                for n, g in grads.items():
                    accumulated[n] += g / k
                norms.append({n: float(np.linalg.norm(g)) for n, g in accumulated.items()})
            for n in p:
                mean[n] += accumulated[n] / dp
            out["accumulated"].append(accumulated)
            out["losses"].append(losses)
            out["norms"].append(norms)
            out["micro"].append(micros)
        out["device"] = {n: float(np.linalg.norm(g)) for n, g in mean.items()}
        out["mean_grad"] = {n: g.copy() for n, g in mean.items()}
        out["params_before"] = {n: v.copy() for n, v in p.items()}
        grad_norm = float(np.sqrt(sum(np.sum(g ** 2) for g in mean.values())))
        out["grad_norm"] = grad_norm
        out["device_loss"] = float(np.mean(out["losses"]))
        scale = max_norm / grad_norm if 0 < max_norm < grad_norm else 1.0
        out["clipped"] = scale < 1.0
        for n in p:
            p[n] = p[n] - lr * scale * mean[n]
        out["params"] = {n: v.copy() for n, v in p.items()}
        history.append(out)
    return history


EXPERTS, EP = 4, 2


def router_weight(seed: int = 17) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((H, EXPERTS))


def router_tokens(rank: int, step: int, rows: int) -> np.ndarray:
    return np.random.default_rng(100 + 10 * step + rank).standard_normal((rows, S, H))


def routed(weight: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Tokens per expert when each token goes to its top-1 expert."""
    return np.bincount((tokens @ weight).argmax(-1).reshape(-1), minlength=EXPERTS)


def router_gradient(weight: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """d mean((x W)^2) / d W."""
    flat = tokens.reshape(-1, H)
    return 2 * flat.T @ (flat @ weight) / (flat.shape[0] * EXPERTS)


# The virtual pipeline: PP stages x 2 chunks = 4 layers; layer v lives on stage v % PP as its chunk v // PP.
PP, VPP_CHUNKS = 2, 2
VPP_LAYERS = PP * VPP_CHUNKS
VPP_WIDTHS = (6, 5, 4, 5, 3)   # layer v maps width v to width v + 1


def vpp_width(boundary: int) -> int:
    return VPP_WIDTHS[boundary]


def vpp_parameters(seed: int = 7) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for v in range(VPP_LAYERS):
        out[f"layer{v}.weight"] = 0.6 * rng.standard_normal((VPP_WIDTHS[v], VPP_WIDTHS[v + 1]))
        out[f"layer{v}.bias"] = 0.1 * rng.standard_normal(VPP_WIDTHS[v + 1])
    return out


def vpp_activations(p: dict, x: np.ndarray) -> list:
    """The output of every layer (tanh but the last)."""
    outs = []
    for v in range(VPP_LAYERS):
        x = x @ p[f"layer{v}.weight"] + p[f"layer{v}.bias"]
        x = x if v == VPP_LAYERS - 1 else np.tanh(x)
        outs.append(x)
    return outs


def vpp_forward(p: dict, x: np.ndarray, target: np.ndarray):
    return float(np.mean((vpp_activations(p, x)[-1] - target) ** 2)), None
