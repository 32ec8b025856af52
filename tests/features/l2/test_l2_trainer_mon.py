"""L2 features through msprobe's TrainerMon: a tiny attention model, K = 2 micro-batches, 2 steps; the
attention_hook and linear_hook CSV rows against float64 numpy computed from the inputs and the weights
the step used; the same through kj600's hook_modules into its TensorBoard, in msprobe's tag spelling, read
back with TensorBoard's reader; ConfigErrors for bad L2 keys; nothing attached when recording_l2_features
is off."""
import glob
import json
import os

import numpy as np
import pytest

import mindspore as ms
from mindspore import mint, nn, value_and_grad

from mindmon.config import ConfigError
from mindmon.formats.msprobe_csv import read_csv
from mindmon.kj600.module_hook import TrainerMon as Kj600TrainerMon
from mindmon.msprobe import TrainerMon
from mindmon.sinks.tensorboard import msprobe_tensorboard_sink
from tests.features.l2.test_l2_features import reference_features

K, STEPS, BATCH, SEQ, HEADS, DIM = 2, 2, 2, 5, 2, 4
HIDDEN = HEADS * DIM


class Core(nn.Cell):
    """softmax(Q K^T / sqrt(d)) V over (batch, seq, heads, dim) inputs, causal."""

    def construct(self, q, k, v):
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = mint.matmul(q, k.transpose(0, 1, 3, 2)) / float(np.sqrt(DIM))
        mask = ms.Tensor(np.triu(np.full((SEQ, SEQ), -1e9, np.float32), 1))
        return mint.matmul(mint.softmax(scores + mask, dim=-1), v).transpose(0, 2, 1, 3)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.wq = nn.Dense(HIDDEN, HIDDEN, has_bias=False)
        self.wk = nn.Dense(HIDDEN, HIDDEN, has_bias=False)
        self.core = Core()
        self.out = nn.Dense(HIDDEN, 3)

    def construct(self, x):
        q = self.wq(x).reshape(BATCH, SEQ, HEADS, DIM)
        k = self.wk(x).reshape(BATCH, SEQ, HEADS, DIM)
        return self.out(self.core(q, k, q).reshape(BATCH, SEQ, HIDDEN))


def write_config(tmp_path, **keys):
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps(keys))
    return str(path)


def train(config_path, steps=STEPS, door="msprobe", tensorboard_dir=None):
    """Returns {step: (weights at the step's start, [x of each micro-batch])}. `door` "kj600": kj600's
    TrainerMon and its README's recipe (hook_modules, then set_wrapped_optimizer) in place of msprobe's
    set_monitor; with `tensorboard_dir`, msprobe's TrainerMon also writes msprobe's TensorBoard there."""
    ms.set_seed(0)
    model = Net()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.5)
    if door == "kj600":
        monitor = Kj600TrainerMon(config_path, params_have_main_grad=False)
        monitor.hook_modules(model, K)
        Kj600TrainerMon.set_wrapped_optimizer(optimizer)
    else:
        sinks = [msprobe_tensorboard_sink(tensorboard_dir)] if tensorboard_dir else []
        monitor = TrainerMon(config_path, params_have_main_grad=False, extra_sinks=sinks)
        monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    grad_fn = value_and_grad(lambda x: (model(x) ** 2).mean() / K, None, optimizer.parameters)
    rng = np.random.default_rng(7)
    seen = {}
    for step in range(steps):
        weights = {p.name: p.asnumpy().astype(np.float64).copy() for p in model.trainable_params()}
        xs = [rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32) for _ in range(K)]
        summed = None
        for x in xs:
            _, grads = grad_fn(ms.Tensor(x))
            summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
        optimizer(summed)
        seen[step] = (weights, xs)
    monitor.close()
    return model, seen


def test_attention_and_linear_rows_against_numpy(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = write_config(tmp_path, l2_targets={"attention_hook": ["0:core"], "linear_hook": []},
                          recording_l2_features=True, sa_order="b,s,h,d", ndigits=12)
    _, seen = train(config)
    (folder,) = glob.glob(str(tmp_path / "out" / "*-rank0-*"))
    rows = [r for path in sorted(glob.glob(os.path.join(folder, "*.csv"))) for r in read_csv(path)]
    attention = [r for r in rows if r.kind == "attention_hook"]
    linear = [r for r in rows if r.kind == "linear_hook"]
    assert {(r.name, r.step - 1, r.micro_step) for r in attention} == \
        {("core.attention", s, m) for s in range(STEPS) for m in range(K)}
    assert {(r.name, r.step - 1) for r in linear} == {(f"{c}.linear", s) for c in ("wq", "wk", "out")
                                                      for s in range(STEPS)}
    for record in attention:
        weights, xs = seen[record.step - 1]
        x = xs[record.micro_step].astype(np.float64)
        q = (x @ weights["wq.weight"].T).reshape(BATCH, SEQ, HEADS, DIM)
        k = (x @ weights["wk.weight"].T).reshape(BATCH, SEQ, HEADS, DIM)
        assert record.value == pytest.approx(reference_features(q, k, causal=True), rel=1e-5), record
    for record in linear:
        w = seen[record.step - 1][0][record.name.replace(".linear", ".weight")]
        singular = np.linalg.svd(w, compute_uv=False)
        frobenius = np.linalg.norm(w)
        assert record.value == pytest.approx([frobenius / singular[0], frobenius], rel=1e-4), record
    # Training moved the weights: the second step's rows are not the first's.
    assert linear[0].value != [r for r in linear if r.name == linear[0].name and r.step == 2][0].value


def numpy_features(seen):
    """{(tag name, step): {statistic: float64 numpy value}} in msprobe's spelling, from the inputs and weights."""
    expected = {}
    for step, (weights, xs) in seen.items():
        for micro, x in enumerate(xs):
            q = (x.astype(np.float64) @ weights["wq.weight"].T).reshape(BATCH, SEQ, HEADS, DIM)
            k = (x.astype(np.float64) @ weights["wk.weight"].T).reshape(BATCH, SEQ, HEADS, DIM)
            expected[(f"0:core.attention:{micro}/rank0/qkt", step)] = dict(zip(
                ("entropy", "softmax_max", "entropy_mean", "softmax_max_mean"), reference_features(q, k, causal=True)))
        for cell in ("wq", "wk", "out"):
            w = weights[f"{cell}.weight"]
            frobenius = np.linalg.norm(w)
            expected[(f"0:{cell}.linear/rank0/sr", step)] = {
                "sr": frobenius / np.linalg.svd(w, compute_uv=False)[0], "kernel_norm": frobenius}
    return expected


@pytest.mark.parametrize("door", ["kj600", "msprobe"])
def test_tensorboard_in_msprobes_spelling(tmp_path, monkeypatch, door):
    """kj600's TensorBoard (its run folder itself), and msprobe's TrainerMon given msprobe's TensorBoard sink:
    `0:<cell>.attention:<micro>/rank0/qkt_<entropy|softmax_max>` per micro-batch and
    `0:<cell>.linear/rank0/sr_<sr|kernel_norm>` per step, against the 0-based step, every value numpy's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("KJ600_OUTPUT_DIR", str(tmp_path / "kj600"))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = write_config(tmp_path, l2_targets={"attention_hook": ["0:core"], "linear_hook": []},
                          recording_l2_features=True, sa_order="b,s,h,d")
    _, seen = train(config, door=door, tensorboard_dir=str(tmp_path / "tb"))
    pattern = tmp_path / "kj600" / "*-rank0-*" if door == "kj600" else tmp_path / "tb" / "rank_0"
    (folder,) = glob.glob(str(pattern))
    accumulator = EventAccumulator(folder, size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}
    expected = numpy_features(seen)
    assert set(tags) == {f"{name}_{op}" for name, _ in expected for op in expected[(name, 0)]}
    for (name, step), values in expected.items():
        for op, want in values.items():
            assert tags[f"{name}_{op}"][step] == pytest.approx(want, rel=1e-4), (name, op, step)
    assert all(sorted(points) == list(range(STEPS)) for points in tags.values())


def test_off_attaches_nothing_and_bad_keys_are_config_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    # recording_l2_features false: no hook, no file.
    train(write_config(tmp_path, l2_targets={"linear_hook": []}, recording_l2_features=False), steps=1)
    assert not glob.glob(str(tmp_path / "out" / "*" / "*.csv"))
    bad = [({"l2_targets": {"attention_hook": ["nope"]}, "recording_l2_features": True},
            "l2_targets.attention_hook: 'nope' is not a cell"),
           ({"l2_targets": {"linear_hook": ["core"]}, "recording_l2_features": True},
            "l2_targets.linear_hook: 'core' (Core) has no 2-D"),
           ({"l2_targets": {"mlp_hook": []}}, "l2_targets.mlp_hook: unknown hook"),
           ({"sa_order": "h,s,b,d"}, "sa_order: got 'h,s,b,d' (str); allowed: one of"),
           ({"recording_l2_features": "yes"}, "recording_l2_features: got"),
           ({"cc_distribution": {"enable": True, "cc_codeline": ["a[("]}}, "cc_distribution.cc_codeline: got"),
           ({"cc_distribution": {"enabled": True}}, "cc_distribution.enabled: unknown key")]
    for keys, message in bad:
        with pytest.raises(ConfigError) as error:
            train(write_config(tmp_path, **keys), steps=0)
        assert message in str(error.value), (keys, str(error.value))


def test_alert_rule_on_softmax_max(tmp_path, monkeypatch):
    """An AnomalyNan rule with a threshold on attention_hook's softmax_max fires exactly where numpy's value
    is above it (the threshold: the median of numpy's values, so some fire and some do not)."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    # The same seeds give the same run: numpy's values first, from an unmonitored run.
    _, seen = train(write_config(tmp_path), steps=STEPS)
    expected = {}
    for step, (weights, xs) in seen.items():
        for micro, x in enumerate(xs):
            q = (x.astype(np.float64) @ weights["wq.weight"].T).reshape(BATCH, SEQ, HEADS, DIM)
            k = (x.astype(np.float64) @ weights["wk.weight"].T).reshape(BATCH, SEQ, HEADS, DIM)
            expected[(step, micro)] = reference_features(q, k, causal=True)[1]   # the dump counts from 0
    threshold = float(np.median(list(expected.values())))
    rule = {"rule_name": "AnomalyNan", "args": {"threshold": threshold}, "kinds": ["attention_hook"],
            "statistics": ["softmax_max"]}
    train(write_config(tmp_path, l2_targets={"attention_hook": ["core"]}, recording_l2_features=True,
                       sa_order="b,s,h,d", alert={"rules": [rule], "dump": True}))
    (dump,) = glob.glob(str(tmp_path / "out" / "anomaly_detected" / "rank0" / "anomaly.json"))
    with open(dump) as handle:
        entries = list(json.load(handle).values())
    fired = {(e["step"], e["micro_step"]): e["value"] for e in entries}
    assert set(fired) == {key for key, value in expected.items() if value > threshold}, (fired, expected)
    # msprobe's tag name for the tensor the feature is computed from, as in TensorBoard
    assert {e["tag_name"] for e in entries} == {f"0:core.attention:{micro}/rank0/qkt" for _, micro in fired}
    assert all(value == pytest.approx(expected[key], rel=1e-5) for key, value in fired.items())


def test_attach_l2_features_finds_every_attention_and_linear_cell_of_the_demo_model():
    """The benchmark's entry point: every cell whose construct takes (q, k, ...) and every cell with a 2-D
    weight; the demo's attention cores take 2-D (tokens, heads x head_dim) Q and K, read as one sequence."""
    from tests.support.demo_trainer import SMALL_MODEL, make_model
    from mindmon.features.l2.hooks import attach_l2_features

    model = make_model()
    model.set_train(True)
    monitor, handles = attach_l2_features(model, on_host=True)
    cells = dict(model.cells_and_names())
    core = "decoder.layers.1.self_attention.core_attention"
    captured = []
    cells[core].register_forward_pre_hook(lambda cell, inputs: captured.append([t.asnumpy() for t in inputs[:2]]))
    ids = ms.Tensor(np.random.default_rng(0).integers(0, SMALL_MODEL["vocab_size"], (2, SMALL_MODEL["seq_length"])),
                    ms.int32)
    model(ids, ids)
    records = {(r.kind, r.name): r for r in monitor.collect(1)}
    attention_cells = {n for n, c in cells.items() if type(c).__name__ == "CoreAttention"}
    assert {name for kind, name in records if kind == "attention_hook"} == {f"{n}.attention" for n in attention_cells}
    assert sum(kind == "linear_hook" for kind, _ in records) == len(handles) - len(attention_cells) == 29  # 28 Linear/Router + the embedding
    q, k = (t.astype(np.float64).reshape(1, t.shape[0], SMALL_MODEL["num_attention_heads"], -1) for t in captured[0])
    assert records[("attention_hook", f"{core}.attention")].value == \
        pytest.approx(reference_features(q, k, causal=True), rel=1e-5)
    w = cells["output_layer"].weight.asnumpy().astype(np.float64)
    singular = np.linalg.svd(w, compute_uv=False)
    assert records[("linear_hook", "output_layer.linear")].value == \
        pytest.approx([np.linalg.norm(w) / singular[0], np.linalg.norm(w)], rel=1e-4)
    for handle in handles:
        handle.remove()
    model(ids, ids)
    assert monitor.collect(2) == []


def test_a_cell_without_q_and_k_is_said_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = write_config(tmp_path, l2_targets={"attention_hook": ["wq"], "linear_hook": ["out"]},
                          recording_l2_features=True)
    with caplog.at_level("WARNING", logger="mindmon"):
        train(config)   # wq takes one input: no Q and K
    skipped = [r.getMessage() for r in caplog.records if "attention features of wq.attention skipped" in r.getMessage()]
    assert len(skipped) == 1, skipped
    rows = [r for path in glob.glob(str(tmp_path / "out" / "*" / "*.csv")) for r in read_csv(path)]
    assert {(r.kind, r.name, r.step) for r in rows} == {("linear_hook", "out.linear", s) for s in (1, 2)}


def test_a_yaml_cell_error_names_the_full_key_path():
    from mindmon.features.tensor_stats.config import parse_tensor_stats
    from mindmon.features.l2.hooks import select_l2_cells

    config = parse_tensor_stats({"l2_targets": {"attention_hook": ["nope"]}, "recording_l2_features": True},
                                "monitor.tensor_stats")
    with pytest.raises(ConfigError, match=r"^monitor\.tensor_stats\.l2_targets\.attention_hook: 'nope' is not"):
        select_l2_cells(Net(), config.l2)


def _hooked_cells(model):
    return {name for name, cell in model.cells_and_names() if getattr(cell, "_lazy_forward_hook", None)}


def test_hooks_only_where_switched_on_and_all_gone_after_close(tmp_path, monkeypatch):
    from mindspore import ops

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    for keys, hooked, wrapped in (
            ({"param_distribution": True, "l2_targets": {"linear_hook": []}, "recording_l2_features": False,
              "cc_distribution": {"enable": False}}, set(), False),
            ({"l2_targets": {"attention_hook": ["core"], "linear_hook": ["wq"]}, "recording_l2_features": True,
              "cc_distribution": {"enable": True}}, {"core", "wq"}, True)):
        model = Net()
        optimizer = nn.SGD(model.trainable_params(), learning_rate=0.5)
        monitor = TrainerMon(write_config(tmp_path, **keys), params_have_main_grad=False)
        monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
        assert _hooked_cells(model) == hooked
        assert ("__call__" in vars(ops.AllReduce)) == wrapped
        monitor.close()
        assert _hooked_cells(model) == set() and "__call__" not in vars(ops.AllReduce)


def test_a_refused_optimizer_leaves_nothing_attached(tmp_path):
    from mindspore import ops

    model = Net()
    config = write_config(tmp_path, l2_targets={"linear_hook": []}, recording_l2_features=True,
                          cc_distribution={"enable": True})
    with pytest.raises(ConfigError, match="^optimizer: got _ObjectWithParameters"):
        TrainerMon(config, params_have_main_grad=False).set_monitor(model, K, optimizer=_ObjectWithParameters(model))
    assert _hooked_cells(model) == set() and "__call__" not in vars(ops.AllReduce)


class _ObjectWithParameters:
    """Has the parameters an optimizer has, but neither a Cell's hooks nor step()."""

    def __init__(self, model):
        self.parameters = tuple(model.trainable_params())
