"""A float64 numpy recomputation of every activation and activation gradient of the msprobe test run, and
the model with its ReLU as a cell (so it has a row of its own).

Model: x -> fc1 = Dense(4, 8) -> act = ReLU -> fc2 = Dense(8, 3); loss = MSE(o, y) / K per micro-batch,
K = 2, the same data, weights and AdamWeightDecay updates as msprobe_reference.
"""
import numpy as np

from tests.support.msprobe_reference import K, LR, BETA1, BETA2, WEIGHT_DECAY, batches, make_model, reference_run


def activation_rows(steps, weights_at=None, input_scale=1.0):
    """{(prefix, step, micro_step, row name): float64 array} of actv and actv_grad. `weights_at(step)`:
    {parameter name: array} at the start of a step (default: the single-process run's); the inputs are
    the reference batches times `input_scale` (a data-parallel rank's own data)."""
    if weights_at is None:
        weights = reference_run(steps=steps)
        weights_at = lambda step: {n: weights[("param_origin", step, None, n)]   # noqa: E731
                                   for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
    rows = {}
    for step in range(steps):
        w = weights_at(step)
        for k, (x, y) in enumerate(batches()[step]):
            x, y = x.astype(np.float64) * input_scale, y.astype(np.float64)
            h = x @ w["fc1.weight"].T + w["fc1.bias"]
            a = np.maximum(h, 0)
            o = a @ w["fc2.weight"].T + w["fc2.bias"]
            d_o = 2 * (o - y) / o.size / K
            d_a = d_o @ w["fc2.weight"]
            d_h = d_a * (h > 0)
            forward = {".input": x, ".output": o, "fc1.input": x, "fc1.output": h, "act.input": h,
                       "act.output": a, "fc2.input": a, "fc2.output": o}
            # x is not differentiated: the root's and fc1's input gradients are None, without rows.
            backward = {".output": d_o, "fc2.output": d_o, "fc2.input": d_a, "act.output": d_a,
                        "act.input": d_h, "fc1.output": d_h}
            rows.update({("actv", step, k, name): value for name, value in forward.items()})
            rows.update({("actv_grad", step, k, name): value for name, value in backward.items()})
    return rows


def make_relu_model():
    """msprobe_reference's MLP with its ReLU as a cell."""
    from mindspore import nn

    class ReluMLP(type(make_model())):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU()

        def construct(self, x):
            return self.fc2(self.act(self.fc1(x)))

    return ReluMLP()


def train(monitor_factory, steps, between_steps=None, train_mode=True, optimizer_to_monitor=True,
          wrap_optimizer=False, prepare=None):
    """The msprobe user's loop on the ReLU model: `monitor_factory()` gives the TrainerMon;
    `between_steps(step)` runs after each step (to edit the config file). Returns the monitor."""
    import mindspore as ms
    from mindspore import nn, value_and_grad

    model = make_relu_model()
    model.set_train(train_mode)
    if prepare is not None:
        prepare(model)
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=LR, beta1=BETA1, beta2=BETA2,
                                   weight_decay=WEIGHT_DECAY)
    monitor = monitor_factory()
    if wrap_optimizer:   # kj600: the optimizer is given to the class before hook_modules
        type(monitor).set_wrapped_optimizer(optimizer)
    if optimizer_to_monitor:
        monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    else:
        monitor.hook_modules(model, grad_acc_steps=K)
    loss_fn = nn.MSELoss()
    grad_fn = value_and_grad(lambda x, y: loss_fn(model(x), y) / K, None, optimizer.parameters)
    data = batches()
    for step in range(steps):
        summed = None
        for x, y in data[step % len(data)]:   # longer runs (on/off tests) repeat the data
            _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
            summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
        optimizer(summed)
        if between_steps is not None:
            between_steps(step)
    return monitor


def output_root_for(tmp_path, monkeypatch, dynamic: str = ""):
    """MONITOR_OUTPUT_DIR under tmp_path, DYNAMIC_MONITOR set to `dynamic` (unset when empty)."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "monitor_output"))
    if dynamic:
        monkeypatch.setenv("DYNAMIC_MONITOR", dynamic)
    else:
        monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    return tmp_path / "monitor_output"


def run_config(tmp_path, config, steps=2, **kwargs):
    """`train` with a TrainerMon reading `config` from a config.json written under tmp_path."""
    import json

    from mindmon.msprobe import TrainerMon

    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps(config))
    return train(lambda: TrainerMon(str(path), params_have_main_grad=False), steps, **kwargs)
