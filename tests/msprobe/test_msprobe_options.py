"""msprobe options whose wrong output would be silent, each checked against numpy: `start_iteration` (with
`start_step`), `squash_name` (parameter and activation rows), `all_xy` with `targets` (specs for some cells,
everything for the rest), and the `-k` default (8) of the anomaly analysis."""
import glob
import json
import os

import numpy as np
import pytest

from tests.support.msprobe_reference import K, NAMES, STEPS, batches, make_model, make_optimizer, reference_run, statistic, train_steps
from mindmon.cli import main
from mindmon.formats.msprobe_csv import read_csv
from mindmon.msprobe import TrainerMon

pytestmark = pytest.mark.ms27
OPS = ["min", "max", "mean", "norm"]


def write_config(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def csv_rows(root, kind="*"):
    """{(kind, step, micro_step, name): values} of every CSV file of the one run folder under root."""
    (folder,) = glob.glob(os.path.join(root, "*-rank0-*"))
    rows = {}
    for path in glob.glob(os.path.join(folder, f"{kind}_*.csv")):
        for record in read_csv(path):
            rows[(record.kind, record.step - 1, record.micro_step, record.name)] = dict(zip(record.ops, record.value))
    return rows, sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.csv")))


def close(value, want):
    return abs(value - want) <= 1e-5 * abs(want) + 1e-7


def test_start_iteration_numbers_the_steps_and_start_step_counts_from_it(tmp_path, monkeypatch):
    """set_monitor(start_iteration=5) with start_step 6: the first optimizer call is step 5 (not collected),
    the next two are steps 6 and 7, their rows the reference run's steps 1 and 2."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    path = write_config(tmp_path, {"wg_distribution": True, "param_distribution": True, "ops": OPS, "ndigits": 12,
                                   "start_step": 6})
    model = make_model()
    model.set_train(True)
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    monitor = TrainerMon(path, params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer, start_iteration=5)
    train_steps(model, optimizer)
    monitor.close()
    rows, files = csv_rows(str(tmp_path / "out"))
    assert files == sorted(f"{kind}_{s}-{s}.csv" for kind in ("grad_reduced", "grad_unreduced", "param_origin",
                                                              "param_updated") for s in (6, 7))
    reference = reference_run()
    assert {(kind, step) for kind, step, _, _ in rows} == \
        {(kind, s) for kind in ("grad_reduced", "grad_unreduced", "param_origin", "param_updated") for s in (6, 7)}
    for (kind, step, _, name), values in rows.items():
        for op in OPS:
            assert close(values[op], statistic(reference[(kind, step - 5, None, name)], op)), (kind, step, name, op)


def squashing_model():
    """root -> model (layers: 2 blocks of a Dense 4 -> 4) -> head Dense 4 -> 3; numpy weights."""
    import mindspore as ms
    from mindspore import nn

    rng = np.random.default_rng(5)
    weights = {f"model.layers.{i}.dense": (rng.normal(0, 0.5, (4, 4)).astype(np.float32),
                                           rng.normal(0, 0.1, (4,)).astype(np.float32)) for i in range(2)}
    weights["head"] = (rng.normal(0, 0.5, (3, 4)).astype(np.float32), np.zeros(3, np.float32))

    def dense(name):
        w, b = weights[name]
        return nn.Dense(w.shape[1], w.shape[0], weight_init=ms.Tensor(w), bias_init=ms.Tensor(b))

    class Block(nn.Cell):
        def __init__(self, name):
            super().__init__()
            self.dense = dense(name)

        def construct(self, x):
            return self.dense(x)

    class Inner(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([Block(f"model.layers.{i}.dense") for i in range(2)])

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.model, self.head = Inner(), dense("head")

        def construct(self, x):
            return self.head(self.model(x))

    return Net(), weights


def run_squashing(tmp_path, monkeypatch, config, steps=1):
    """One step (K micro-batches) of the squashing model; its CSV rows, and numpy's forward of each
    Dense's input and output per micro-batch."""
    import mindspore as ms
    from mindspore import nn, value_and_grad

    root = tmp_path / f"out{len(os.listdir(tmp_path))}"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(root))
    model, weights = squashing_model()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)
    monitor = TrainerMon(write_config(tmp_path, config), params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    grad_fn = value_and_grad(lambda x, y: ((model(x) - y) ** 2).mean() / K, None, optimizer.parameters)
    forwards = {}
    for step in range(steps):
        summed = None
        for micro, (x, y) in enumerate(batches()[step]):
            _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
            summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
            h = x.astype(np.float64)
            for name in ("model.layers.0.dense", "model.layers.1.dense", "head"):
                w, b = weights[name]
                out = h @ w.T.astype(np.float64) + b
                forwards[(step, micro, name)] = (h, out)
                h = out
        optimizer(summed)
    monitor.close()
    return csv_rows(str(root))[0], weights, forwards


def test_squash_name_shortens_parameter_and_activation_rows(tmp_path, monkeypatch):
    config = {"param_distribution": True, "xy_distribution": True, "forward_only": True, "squash_name": True,
              "targets": {"layers.0.dense": {}, "head": {}}, "ops": OPS, "ndigits": 12}
    rows, weights, forwards = run_squashing(tmp_path, monkeypatch, config)
    params = {name for kind, _, _, name in rows if kind == "param_origin"}
    assert params == {"layers.0.dense.weight", "layers.0.dense.bias", "head.weight", "head.bias"}
    for name, (w, b) in (("layers.0.dense", weights["model.layers.0.dense"]), ("head", weights["head"])):
        for suffix, array in (("weight", w), ("bias", b)):
            for op in OPS:
                assert close(rows[("param_origin", 0, None, f"{name}.{suffix}")][op], statistic(array, op))
    actv = {name for kind, _, _, name in rows if kind == "actv"}
    assert actv == {"layers.0.dense.input", "layers.0.dense.output", "head.input", "head.output"}
    for micro in range(K):
        for row, full in (("layers.0.dense", "model.layers.0.dense"), ("head", "head")):
            inputs, outputs = forwards[(0, micro, full)]
            for io, array in (("input", inputs), ("output", outputs)):
                for op in OPS:
                    assert close(rows[("actv", 0, micro, f"{row}.{io}")][op], statistic(array, op)), (row, io, op)


def test_all_xy_with_targets_specs_for_some_cells_everything_for_the_rest(tmp_path, monkeypatch):
    """targets give `model.layers.0.dense` a spec (its input only); all_xy hooks every other cell with
    everything (input, output, their gradients)."""
    from mindmon.compat import named_cells

    config = {"xy_distribution": True, "all_xy": True, "ops": OPS, "ndigits": 12,
              "targets": {"model.layers.0.dense": {"input": "tensor"}}}
    rows, _, forwards = run_squashing(tmp_path, monkeypatch, config)
    cells = [name for name, _ in named_cells(squashing_model()[0])]
    actv = {name for kind, _, _, name in rows if kind == "actv"}
    others = [c for c in cells if c != "model.layers.0.dense" and c != "model.layers"]   # a CellList has no forward
    assert actv == {"model.layers.0.dense.input"} | {f"{c}.{io}" for c in others for io in ("input", "output")}
    grads = {name for kind, _, _, name in rows if kind == "actv_grad"}
    assert not any(name.startswith("model.layers.0.dense.") for name in grads)
    assert {"head.output", "model.layers.1.dense.output", ".output"} <= grads
    for micro in range(K):
        checks = (("model.layers.0.dense.input", forwards[(0, micro, "model.layers.0.dense")][0]),
                  ("model.layers.1.dense.output", forwards[(0, micro, "model.layers.1.dense")][1]),
                  ("head.output", forwards[(0, micro, "head")][1]), (".output", forwards[(0, micro, "head")][1]))
        for row, array in checks:
            for op in OPS:
                assert close(rows[("actv", 0, micro, row)][op], statistic(array, op)), (row, op)


def test_anomaly_analysis_keeps_the_first_8_by_default(tmp_path, monkeypatch, capsys):
    """A real dump (AnomalyNan, threshold 0: every norm above 0 of every step), then `mindmon anomalies`
    without -k: the first 8 in (step, phase: gradients < optimizer state, call order)."""
    root = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(root))
    path = write_config(tmp_path, {"wg_distribution": True, "mv_distribution": True, "ops": ["norm"],
                                   "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 0.0}}],
                                             "dump": True}})
    from tests.support.msprobe_reference import msprobe_loop

    msprobe_loop(TrainerMon, path).close()
    folder = root / "anomaly_detected"
    with open(folder / "rank0" / "anomaly.json") as handle:
        dumped = json.load(handle)
    reference = reference_run()
    fired = {(kind, step, name) for kind in ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq")
             for name in NAMES for step in range(STEPS) if statistic(reference[(kind, step, None, name)], "norm") > 0}
    assert {(e["kind"], e["step"], e["name"].rpartition("/")[0]) for e in dumped.values()} == fired
    assert len(dumped) > 8
    assert main(["anomalies", "-d", str(folder)]) == 0
    with open(folder / "anomaly_analyse.json") as handle:
        kept = list(json.load(handle))
    phase = {"grad_unreduced": 1, "grad_reduced": 1, "exp_avg": 2, "exp_avg_sq": 2}
    order = sorted(dumped, key=lambda k: (dumped[k]["step"], phase[dumped[k]["kind"]], dumped[k]["call_id"]))
    assert kept == order[:8]
