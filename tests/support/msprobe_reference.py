"""An independent float64 numpy recomputation of a small msprobe-style training run, and the user loops.

Model: x -> Dense(4, 8) -> ReLU -> Dense(8, 3), MSE loss; K = 2 micro-batches of 4 samples per step;
each micro-batch contributes the gradient of loss_k / K; the summed gradient goes to the optimizer.
Everything msprobe's CSV files describe (weights before/after the update, per-micro-batch and summed
gradients, Adam moments before the update) is recomputed here by hand: forward, backward, optimizer.
"""
import numpy as np

K = 2
STEPS = 3
MICRO_BATCH = 4
LR, BETA1, BETA2, WEIGHT_DECAY = 0.01, 0.9, 0.999, 0.01
# MindSpore's Adam optimizers keep beta1/beta2 as float32 (0.999 -> 0.99900001287: 1 - beta2 moves by
# 1.3e-5 relative); the reference takes the same values, in float64 arithmetic.
BETA1_F32, BETA2_F32 = float(np.float32(BETA1)), float(np.float32(BETA2))
NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def initial_weights():
    rng = np.random.default_rng(1234)
    return {"fc1.weight": rng.normal(0, 0.5, (8, 4)).astype(np.float32),
            "fc1.bias": rng.normal(0, 0.1, (8,)).astype(np.float32),
            "fc2.weight": rng.normal(0, 0.5, (3, 8)).astype(np.float32),
            "fc2.bias": np.zeros((3,), np.float32)}   # all zeros: `zeros` = 1 at step 0


def batches():
    """[step][micro_step] -> (x, y), float32."""
    rng = np.random.default_rng(99)
    def micro_batch():
        return (rng.normal(size=(MICRO_BATCH, 4)).astype(np.float32),
                rng.normal(size=(MICRO_BATCH, 3)).astype(np.float32))

    return [[micro_batch() for _ in range(K)] for _ in range(STEPS)]


def gradients(w, x, y):
    """Gradients of mean((o - y)^2) / K in float64."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    h = x @ w["fc1.weight"].T + w["fc1.bias"]
    a = np.maximum(h, 0)
    o = a @ w["fc2.weight"].T + w["fc2.bias"]
    d_o = 2 * (o - y) / o.size / K
    d_h = (d_o @ w["fc2.weight"]) * (h > 0)
    return {"fc1.weight": d_h.T @ x, "fc1.bias": d_h.sum(0), "fc2.weight": d_o.T @ a, "fc2.bias": d_o.sum(0)}


def adam_weight_decay(w, g, m, v, t, eps=1e-6):
    """mindspore.nn.AdamWeightDecay: no bias correction, decay added to the update."""
    m = BETA1_F32 * m + (1 - BETA1_F32) * g
    v = BETA2_F32 * v + (1 - BETA2_F32) * g * g
    return w - LR * (m / (eps + np.sqrt(v)) + WEIGHT_DECAY * w), m, v


def adamw_torch(w, g, m, v, t, eps=1e-8):
    """mindspore.experimental.optim.AdamW (PyTorch's AdamW)."""
    w = w * (1 - LR * WEIGHT_DECAY)
    m = BETA1_F32 * m + (1 - BETA1_F32) * g
    v = BETA2_F32 * v + (1 - BETA2_F32) * g * g
    denom = np.sqrt(v) / np.sqrt(1 - BETA2_F32 ** t) + eps
    return w - LR / (1 - BETA1_F32 ** t) * m / denom, m, v


def reference_run(update=adam_weight_decay, steps=STEPS):
    """{(prefix, step, micro_step, name): float64 array} for every row msprobe's CSV files can hold."""
    w = {n: a.astype(np.float64) for n, a in initial_weights().items()}
    m = {n: np.zeros_like(a) for n, a in w.items()}
    v = {n: np.zeros_like(a) for n, a in w.items()}
    rows = {}
    for step, micro_batches in enumerate(batches()[:steps]):
        total = {n: 0.0 for n in NAMES}
        for k, (x, y) in enumerate(micro_batches):
            g = gradients(w, x, y)
            for n in NAMES:
                rows[("grad_unreduced", step, k, n)] = g[n]
                total[n] = total[n] + g[n]
        for n in NAMES:
            rows.update({("param_origin", step, None, n): w[n], ("grad_reduced", step, None, n): total[n],
                         ("grad_unreduced", step, None, n): total[n],
                         ("exp_avg", step, None, n): m[n], ("exp_avg_sq", step, None, n): v[n]})
            w[n], m[n], v[n] = update(w[n], total[n], m[n], v[n], step + 1)
            rows[("param_updated", step, None, n)] = w[n]
    return rows


def statistic(array, op, eps=1e-8):
    flat = np.asarray(array, np.float64).reshape(-1)
    return {"min": flat.min(), "max": flat.max(), "mean": flat.mean(), "norm": np.sqrt((flat * flat).sum()),
            "zeros": np.count_nonzero(np.abs(flat) < eps) / flat.size, "nans": np.count_nonzero(np.isnan(flat))}[op]


# --- the user's side: a model and three loop shapes, written as an msprobe user writes them ---------

def make_model():
    import mindspore as ms
    from mindspore import nn, ops

    weights = initial_weights()

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Dense(4, 8, weight_init=ms.Tensor(weights["fc1.weight"]),
                                bias_init=ms.Tensor(weights["fc1.bias"]))
            self.fc2 = nn.Dense(8, 3, weight_init=ms.Tensor(weights["fc2.weight"]),
                                bias_init=ms.Tensor(weights["fc2.bias"]))

        def construct(self, x):
            return self.fc2(ops.relu(self.fc1(x)))

    return MLP()


def make_optimizer(kind, parameters):
    from mindspore import nn
    from mindspore.experimental import optim

    if kind == "AdamWeightDecay":
        return nn.AdamWeightDecay(parameters, learning_rate=LR, beta1=BETA1, beta2=BETA2, weight_decay=WEIGHT_DECAY)
    if kind == "experimental.AdamW":
        return optim.AdamW(parameters, lr=LR, betas=(BETA1, BETA2), weight_decay=WEIGHT_DECAY)
    if kind == "experimental.Adam":
        return optim.Adam(parameters, lr=LR, betas=(BETA1, BETA2))
    if kind == "Adam":
        return nn.Adam(parameters, learning_rate=LR, beta1=BETA1, beta2=BETA2)
    if kind == "mindformers.AdamW":
        from mindformers.core.optim import AdamW
        return AdamW(parameters, learning_rate=LR, betas=(BETA1, BETA2), weight_decay=WEIGHT_DECAY)
    raise ValueError(kind)


def msprobe_loop(TrainerMon, config_path, optimizer_kind="AdamWeightDecay", steps=STEPS):
    """The loop an msprobe user writes: value_and_grad on loss / K per micro-batch, gradients summed,
    one optimizer call per step. Returns the monitor."""
    model = make_model()
    model.set_train(True)
    optimizer = make_optimizer(optimizer_kind, model.trainable_params())
    monitor = TrainerMon(config_path, params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    train_steps(model, optimizer, steps)
    return monitor


def train_steps(model, optimizer, steps=STEPS, before_update=None):
    """value_and_grad on loss / K per micro-batch, gradients summed, one optimizer call per step;
    `before_update(summed)` is called before each call."""
    import mindspore as ms
    from mindspore import nn, value_and_grad

    loss_fn = nn.MSELoss()
    grad_fn = value_and_grad(lambda x, y: loss_fn(model(x), y) / K, None, optimizer.parameters)
    for step in range(steps):
        summed = None
        for x, y in batches()[step]:
            _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
            summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
        if before_update is not None:
            before_update(summed)
        optimizer(summed)


def main_grad_loop(TrainerMon, config_path, attribute="main_grad", steps=STEPS):
    """Megatron style: gradients are accumulated into each parameter's `main_grad` (or `grad`) and a
    wrapper (a plain object holding the real optimizer in `.optimizer`) runs `step()` without them."""
    import mindspore as ms
    from mindspore import nn, value_and_grad

    class GradsFromParameters:
        def __init__(self, optimizer):
            self.optimizer = optimizer
            self.parameters = optimizer.parameters

        def step(self):
            return self.optimizer(tuple(getattr(p, attribute) for p in self.parameters))

    model = make_model()
    inner = make_optimizer("AdamWeightDecay", model.trainable_params())
    optimizer = GradsFromParameters(inner)
    monitor = TrainerMon(config_path, params_have_main_grad=attribute == "main_grad")
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    loss_fn = nn.MSELoss()
    grad_fn = value_and_grad(lambda x, y: loss_fn(model(x), y) / K, None, inner.parameters)
    for step in range(steps):
        for p in inner.parameters:
            setattr(p, attribute, ms.ops.zeros_like(p))
        for x, y in batches()[step]:
            _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
            for p, g in zip(inner.parameters, grads):
                setattr(p, attribute, getattr(p, attribute) + g)
        optimizer.step()
    return monitor


def accumulating_step_loop(TrainerMon, config_path, steps=STEPS):
    """mindmon's own AccumulatingTrainStep (it divides the loss by K itself), without clipping."""
    import mindspore as ms
    from mindspore import nn

    from mindmon.loop.step import AccumulatingTrainStep

    model = make_model()
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    monitor = TrainerMon(config_path, params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    loss_fn = nn.MSELoss()
    train_step = AccumulatingTrainStep(lambda x, y: loss_fn(model(x), y), optimizer, K, max_norm=0)
    for step in range(steps):
        train_step([(ms.Tensor(x), ms.Tensor(y)) for x, y in batches()[step]])
    return monitor
