"""A mindnlp (HuggingFace model code) Qwen2 causal LM with grouped-query attention, trained through the
plain loop with every train_state switch, the max-logit probe on its attention function and msprobe's
TrainerMon, with no adapter on the user's side. Every number is checked against a recomputation:
gradients of a second copy of the model (same weights, MindSpore's value_and_grad), accumulated, clipped
and applied in float64 numpy; max logits from that copy's q/k projections, rotated and multiplied in numpy.

Runs in the MindSpore 2.7 environment (`make test-ms27`), in its own pytest process: `import mindnlp`
changes `mindspore.Tensor` for the whole process.
"""
import glob
import json
import os

import numpy as np
import pytest

from tests.support.jsonl import read_jsonl

pytestmark = [pytest.mark.ms27, pytest.mark.mindnlp]

K, STEPS, LR, MAX_NORM, BATCH, SEQ = 2, 2, 0.5, 2.0, 4, 8
HEADS, KV_HEADS, HIDDEN, ROPE_THETA = 4, 2, 32, 10000.0
HEAD_DIM = HIDDEN // HEADS
LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


class SGD:
    """The optimizer contract of AccumulatingTrainStep: `.parameters`, called with the gradients.
    (mindnlp 0.5.1's torch-style optimizers have no CPU kernels: raw_sgd, addcdiv.)"""

    def __init__(self, parameters, lr):
        self.parameters, self.lr = tuple(parameters), lr

    def __call__(self, grads):
        return self.step(grads)

    def step(self, grads):
        for parameter, grad in zip(self.parameters, grads):
            parameter.copy_(parameter - self.lr * grad)


@pytest.fixture(scope="module")
def qwen2():
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    import mindnlp  # noqa: F401  (as a user's script does: mindnlp's Tensor for the whole process)
    import transformers.models.qwen2.modeling_qwen2 as modeling
    from mindnlp.transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=len(LAYERS),
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32,
                         rope_theta=ROPE_THETA, tie_word_embeddings=False, attn_implementation="eager")
    return config, Qwen2ForCausalLM, modeling


def _batches():
    rng = np.random.default_rng(5)
    return rng.integers(0, 64, (STEPS, BATCH, SEQ)).astype(np.int64)


def _rope(x):
    """Rotary embedding of (batch, heads, seq, head_dim), positions 0..seq-1, as Qwen2 applies it."""
    inv_freq = 1.0 / ROPE_THETA ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    angles = np.outer(np.arange(x.shape[2], dtype=np.float64), inv_freq)
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    half = HEAD_DIM // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _max_logits(q_proj, k_proj):
    """Per query head: max over batch and causal positions of q.k / sqrt(d); head h reads kv head h // 2."""
    q = _rope(q_proj.reshape(BATCH // K, SEQ, HEADS, HEAD_DIM).transpose(0, 2, 1, 3))
    k = _rope(k_proj.reshape(BATCH // K, SEQ, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3))
    allowed = np.tril(np.ones((SEQ, SEQ), bool))
    group = HEADS // KV_HEADS
    return np.array([(q[:, h] @ k[:, h // group].transpose(0, 2, 1) / np.sqrt(HEAD_DIM))[:, allowed].max()
                     for h in range(HEADS)])


def replay(qwen2, initial):
    """Per step, from a second model: micro losses, accumulated gradients A_k (float64), max logits per
    layer, the weights before and after the clipped SGD update (float64)."""
    import mindspore as ms

    config, model_class, _ = qwen2
    model = model_class(config)
    names = [name for name, _ in model.named_parameters()]
    captured = {}
    for layer in LAYERS:
        attention = model.get_submodule(layer)
        for proj in ("q_proj", "k_proj"):
            getattr(attention, proj).register_forward_hook(
                lambda module, args, output, key=(layer, proj): captured.__setitem__(key, output.asnumpy()))
    grad_fn = ms.value_and_grad(lambda ids: model(input_ids=ids, labels=ids).loss, None, tuple(model.parameters()))
    weights, steps = {n: initial[n].astype(np.float64) for n in names}, []
    for batch in _batches():
        for name, parameter in model.named_parameters():
            parameter.copy_(ms.Tensor(weights[name].astype(np.float32)))
        accumulated, record = {n: 0.0 for n in names}, {"losses": [], "A": [], "logits": {}, "before": dict(weights)}
        for k in range(K):
            loss, grads = grad_fn(ms.Tensor(batch[k * BATCH // K:(k + 1) * BATCH // K]))
            record["losses"].append(float(loss.asnumpy()))
            accumulated = {n: accumulated[n] + g.asnumpy().astype(np.float64) / K for n, g in zip(names, grads)}
            record["A"].append(dict(accumulated))
            for layer in LAYERS:
                heads = _max_logits(captured[(layer, "q_proj")].astype(np.float64),
                                    captured[(layer, "k_proj")].astype(np.float64))
                record["logits"][layer] = np.maximum(record["logits"].get(layer, heads), heads)
        norm = np.sqrt(sum(np.sum(a * a) for a in accumulated.values()))
        scale = MAX_NORM / norm if norm > MAX_NORM else 1.0
        weights = {n: weights[n] - LR * scale * accumulated[n] for n in names}
        record.update(norm=norm, applied={n: scale * accumulated[n] for n in names}, after=dict(weights))
        steps.append(record)
    return names, steps


def train(qwen2, tmp_path, monkeypatch):
    """The user's script: a mindnlp model, mindmon's plain loop, probes and TrainerMon; nothing adapted."""
    import mindspore as ms

    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
    from mindmon import parameter_names
    from mindmon.msprobe import TrainerMon
    from mindmon.probes import track_attention_function

    config, model_class, modeling = qwen2
    model = model_class(config)
    initial = {name: p.asnumpy().copy() for name, p in model.named_parameters()}
    optimizer = SGD(model.parameters(), LR)
    _, wrapped = track_attention_function(
        model, modeling.eager_attention_forward, names=list(LAYERS), num_heads=HEADS, num_kv_heads=KV_HEADS,
        query_arg=1, key_arg=2, causal=True, layer_of=lambda args, kwargs: LAYERS[args[0].layer_idx])
    monkeypatch.setattr(modeling, "eager_attention_forward", wrapped)
    group = build_group(parse_sections({
        "monitor": {"output_dir": str(tmp_path / "monitor"), "train_state": {
            "local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True}},
        "callbacks": [{"type": "MaxLogitsMonitor", "step_interval": 1}]}),
        model=model, parameter_names=parameter_names(model, optimizer))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "msprobe"))
    (tmp_path / "config.json").write_text(json.dumps({
        "targets": {}, "param_distribution": True, "wg_distribution": True, "format": "csv",
        "ops": ["min", "max", "mean", "norm"], "ndigits": 12}))
    TrainerMon(str(tmp_path / "config.json"), params_have_main_grad=False).set_monitor(
        model, grad_acc_steps=K, optimizer=optimizer)
    train_step = AccumulatingTrainStep(lambda ids: model(input_ids=ids, labels=ids).loss, optimizer,
                                       num_micro_steps=K, group=group, max_norm=MAX_NORM)
    group.setup(max_steps=STEPS)
    results = []
    for step, batch in enumerate(_batches(), start=1):
        loss, grad_norm = train_step(split_batch((ms.Tensor(batch),), K))
        group.flush(step)
        results.append((float(loss.asnumpy()), grad_norm))
    group.close()
    final = {name: p.asnumpy().copy() for name, p in model.named_parameters()}
    return initial, results, final


def test_qwen2_gqa_through_the_plain_loop_probes_and_trainer_mon(qwen2, tmp_path, monkeypatch):
    initial, results, final = train(qwen2, tmp_path, monkeypatch)
    names, steps = replay(qwen2, initial)
    records = read_jsonl(tmp_path / "monitor" / "rank_0" / "metrics.jsonl")
    values = {(r["kind"], r["step"], r["micro_step"], r["name"]): r["value"] for r in records}
    for step, ref in enumerate(steps, start=1):
        previous = {n: 0.0 for n in names}
        for k in range(K):
            assert values[("local_loss", step, k, "loss")] == pytest.approx(ref["losses"][k], rel=1e-5)
            for n in names:
                norm = np.linalg.norm(ref["A"][k][n])
                # float32 gradients against float64: 1e-4 of the norm, and 1e-6 absolute for the differences
                assert values[("local_norm", step, k, n)] == pytest.approx(norm - previous[n], rel=1e-4, abs=1e-6), n
                previous[n] = norm
        for n in names:
            assert values[("device_norm", step, None, n)] == pytest.approx(previous[n], rel=1e-5), n
        assert values[("device_loss", step, None, "loss")] == pytest.approx(np.mean(ref["losses"]), rel=1e-5)
        assert results[step - 1][0] == pytest.approx(np.mean(ref["losses"]), rel=1e-5)
        assert results[step - 1][1] == pytest.approx(ref["norm"], rel=1e-5)
        for layer in LAYERS:
            np.testing.assert_allclose(values[("max_attention_logit", step, None, f"{layer}.max_logits_val")],
                                       ref["logits"][layer], rtol=1e-4)
    assert any(ref["norm"] > MAX_NORM for ref in steps), "the clipping path is not exercised"
    for n in names:
        np.testing.assert_allclose(final[n], steps[-1]["after"][n], rtol=1e-4, atol=1e-6)
    _check_msprobe_csv(tmp_path / "msprobe", names, steps)


def _check_msprobe_csv(root, names, steps):
    """Every row of every CSV, named by the model's parameter names, against the replay."""
    from mindmon.formats.msprobe_csv import read_csv

    folders = glob.glob(str(root / "*-rank0-*"))
    assert len(folders) == 1, folders
    rows = {}
    for path in glob.glob(os.path.join(folders[0], "*.csv")):
        for record in read_csv(path):
            assert record.dtype == "Float32", (path, record.name, record.dtype)   # as without mindnlp
            rows[(record.kind, record.step - 1, record.name)] = dict(zip(record.ops, record.value))
    expected = {}
    for step, ref in enumerate(steps):
        for n in names:
            expected.update({("param_origin", step, n): ref["before"][n], ("param_updated", step, n): ref["after"][n],
                             ("grad_unreduced", step, n): ref["A"][-1][n],
                             ("grad_reduced", step, n): ref["applied"][n]})
    assert set(rows) == set(expected)
    for key, array in expected.items():
        want = {"min": array.min(), "max": array.max(), "mean": array.mean(), "norm": np.linalg.norm(array)}
        scale = np.abs(array).max()
        for op, value in rows[key].items():
            # float32 training against float64: 1e-4 relative; `mean` relative to the tensor's scale
            assert abs(value - want[op]) <= 1e-4 * (abs(want[op]) if op != "mean" else scale) + 1e-9, (key, op)


def test_qwen2_activations_through_trainer_mon(qwen2, tmp_path, monkeypatch):
    """Forward activations (`xy_distribution`) of a mindnlp module: the MLP's output recomputed in numpy
    from its input (taken by a hook of the test's own) and its weights: down(silu(gate x) * up x)."""
    import mindspore as ms

    from mindmon.compat import with_device_of
    from mindmon.formats.msprobe_csv import read_csv
    from mindmon.msprobe import TrainerMon

    config, model_class, _ = qwen2
    model = model_class(config)
    mlp = model.get_submodule("model.layers.0.mlp")
    inputs = []
    mlp.register_forward_hook(lambda module, args, output: inputs.append(args[0].asnumpy().astype(np.float64)))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "msprobe"))
    (tmp_path / "config.json").write_text(json.dumps({
        "targets": {"model.layers.0.mlp": {"input": "tensor", "output": "tensor"}}, "xy_distribution": True,
        "forward_only": True, "format": "csv", "ops": ["min", "max", "norm"], "ndigits": 12}))
    optimizer = SGD(model.parameters(), LR)
    TrainerMon(str(tmp_path / "config.json")).set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    weights = {name: p.asnumpy().astype(np.float64) for name, p in mlp.named_parameters()}
    grad_fn = ms.value_and_grad(lambda ids: model(input_ids=ids, labels=ids).loss, None, optimizer.parameters)
    _, grads = grad_fn(ms.Tensor(_batches()[0]))
    optimizer(with_device_of(grads, optimizer.parameters))
    x = inputs[0]
    gate, up = x @ weights["gate_proj.weight"].T, x @ weights["up_proj.weight"].T
    expected = {"model.layers.0.mlp.input": x,
                "model.layers.0.mlp.output": (gate / (1 + np.exp(-gate)) * up) @ weights["down_proj.weight"].T}
    (path,) = glob.glob(str(tmp_path / "msprobe" / "*-rank0-*" / "actv_0-0.csv"))
    rows = {record.name: dict(zip(record.ops, record.value)) for record in read_csv(path)}
    assert set(rows) == set(expected)
    for name, array in expected.items():
        want = {"min": array.min(), "max": array.max(), "norm": np.linalg.norm(array)}
        for op, value in rows[name].items():
            assert value == pytest.approx(want[op], rel=1e-5), (name, op)
