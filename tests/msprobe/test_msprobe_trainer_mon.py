"""TrainerMon on real MindSpore (CPU): every statistic of every CSV against a float64 numpy recomputation."""
import csv
import logging
import glob
import json
import math
import os

import numpy as np
import pytest

from tests.support.msprobe_reference import (BETA1_F32, BETA2_F32, K, NAMES, STEPS, accumulating_step_loop, adamw_torch,
                               batches, gradients,
                               initial_weights, main_grad_loop, msprobe_loop, reference_run, statistic)
from mindmon.formats import jsonl
from mindmon.formats.msprobe_csv import read_csv
from mindmon.msprobe import TrainerMon

pytestmark = pytest.mark.ms27   # also runs on MindSpore 2.7 (make test-ms27)

# The configurations of msprobe's documentation, `norm` included.
WEIGHT_GRADIENTS = {"targets": {}, "wg_distribution": True, "format": "csv", "ops": ["min", "max", "mean", "norm"],
                    "ndigits": 16}
WEIGHTS = {"targets": {}, "param_distribution": True, "format": "csv", "ops": ["norm", "min", "max", "nans"]}
OPTIMIZER_STATE = {"targets": {}, "mv_distribution": True, "format": "csv", "ops": ["norm", "min", "max", "nans"]}
MICRO_BATCH_GRADIENTS = {"wg_distribution": True, "monitor_mbs_grad": True}
EVERYTHING = {"targets": {}, "param_distribution": True, "wg_distribution": True, "mv_distribution": True,
              "ops": ["min", "max", "norm", "zeros", "nans", "mean"], "eps": 1e-8, "ndigits": 12}
RTOL = 1e-5


@pytest.fixture
def output_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "monitor_output"))
    return tmp_path / "monitor_output"


def write_config(tmp_path, config) -> str:
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def run_folder(root):
    folders = glob.glob(str(root / "*-rank0-*"))
    assert len(folders) == 1, folders
    return folders[0]


def csv_rows(folder):
    """{(prefix, step, micro_step, name): record} over every CSV file of the run."""
    rows = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.csv"))):
        for record in read_csv(path):
            key = (record.kind, record.step - 1, record.micro_step, record.name)
            assert key not in rows, f"{key} written twice"
            rows[key] = record
    return rows


def assert_matches_reference(rows, reference, ndigits, eps=1e-8):
    """Every statistic equals numpy's to RTOL, within the CSV's rounding (half a unit of `ndigits`)."""
    assert rows, "no rows written"
    for key, record in rows.items():
        expected = reference[key]
        assert tuple(record.shape) == expected.shape and record.dtype == "Float32", key
        scale = np.abs(expected).max()
        for op, value in zip(record.ops, record.value):
            want = statistic(expected, op, eps)
            # `mean` can cancel to ~0: its error is relative to the tensor's scale, not to the mean itself.
            tolerance = RTOL * (abs(want) if op != "mean" else scale) + 0.5 * 10 ** -ndigits + 1e-30
            assert abs(value - want) <= tolerance, f"{key} {op}: CSV {value!r}, numpy {want!r}"


def expected_keys(prefixes, steps=STEPS, micro=False):
    keys = set()
    for prefix in prefixes:
        for step in range(steps):
            for k in (range(K) if micro else [None]):
                keys.update((prefix, step, k, name) for name in NAMES)
    return keys


@pytest.mark.parametrize("config, prefixes", [
    (WEIGHT_GRADIENTS, ("grad_reduced", "grad_unreduced")),
    (WEIGHTS, ("param_origin", "param_updated")),
    (OPTIMIZER_STATE, ("exp_avg", "exp_avg_sq")),
], ids=["weight-gradients", "weights", "optimizer-state"])
def test_documented_configs_match_numpy(tmp_path, output_root, config, prefixes):
    msprobe_loop(TrainerMon, write_config(tmp_path, config))
    rows = csv_rows(run_folder(output_root))
    assert set(rows) == expected_keys(prefixes)
    assert_matches_reference(rows, reference_run(), config.get("ndigits", 6))


def test_every_statistic_of_every_file_and_field_counts(tmp_path, output_root):
    msprobe_loop(TrainerMon, write_config(tmp_path, EVERYTHING))
    folder = run_folder(output_root)
    prefixes = ("param_origin", "param_updated", "grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq")
    assert sorted(os.listdir(folder)) == sorted(f"{p}_{s}-{s}.csv" for p in prefixes for s in range(STEPS))
    for path in glob.glob(os.path.join(folder, "*.csv")):
        with open(path, newline="") as file:
            table = list(csv.reader(file))
        assert table[0] == ["vpp_stage", "name", "step"] + EVERYTHING["ops"] + ["shape", "dtype"]
        assert len(table) == 1 + len(NAMES) and all(len(row) == len(table[0]) for row in table)
    rows = csv_rows(folder)
    assert set(rows) == expected_keys(prefixes)
    assert_matches_reference(rows, reference_run(), 12)
    # fc2.bias starts at zero: zeros = 1 before step 0, and its Adam state is all zeros at step 0.
    assert rows[("param_origin", 0, None, "fc2.bias")].stat("zeros") == 1.0
    assert rows[("exp_avg_sq", 0, None, "fc1.weight")].stat("norm") == 0.0


def test_csv_text_is_msprobe_layout(tmp_path, output_root):
    msprobe_loop(TrainerMon, write_config(tmp_path, WEIGHTS), steps=1)
    with open(os.path.join(run_folder(output_root), "param_origin_0-0.csv")) as file:
        lines = file.read().splitlines()
    w = initial_weights()["fc1.weight"].astype(np.float64)
    norm = round(float(np.sqrt((w * w).sum())), 6)
    assert lines[0] == "vpp_stage,name,step,norm,min,max,nans,shape,dtype"
    low, high = round(float(w.min()), 6), round(float(w.max()), 6)
    assert lines[1] == f'0,fc1.weight,0,{norm!r},{low!r},{high!r},0.0,"(8, 4)",Float32'


def test_micro_batch_gradients(tmp_path, output_root):
    msprobe_loop(TrainerMon, write_config(tmp_path, MICRO_BATCH_GRADIENTS))
    folder = run_folder(output_root)
    header = open(os.path.join(folder, "grad_unreduced_1-1.csv")).readline().strip()
    assert header == "vpp_stage,name,step,micro_step,norm,shape,dtype"
    rows = csv_rows(folder)
    assert set(rows) == expected_keys(["grad_unreduced"], micro=True) | expected_keys(["grad_reduced"])
    assert_matches_reference(rows, reference_run(), 6)


@pytest.mark.parametrize("loop", [
    lambda path: main_grad_loop(TrainerMon, path, "main_grad"),
    lambda path: main_grad_loop(TrainerMon, path, "grad"),
    lambda path: accumulating_step_loop(TrainerMon, path),
], ids=["main_grad", "param.grad", "AccumulatingTrainStep"])
def test_other_loop_shapes(tmp_path, output_root, loop):
    loop(write_config(tmp_path, EVERYTHING))
    rows = csv_rows(run_folder(output_root))
    prefixes = ("param_origin", "param_updated", "grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq")
    assert set(rows) == expected_keys(prefixes)
    assert_matches_reference(rows, reference_run(), 12)


def test_torch_style_adamw_three_steps(tmp_path, output_root):
    msprobe_loop(TrainerMon, write_config(tmp_path, EVERYTHING), "experimental.AdamW")
    rows = csv_rows(run_folder(output_root))
    assert ("exp_avg_sq", 2, None, "fc1.weight") in rows  # named by the parameter, no max_exp_avg_sq rows
    assert not any("max_exp_avg_sq" in key[3] or "exp_avg." in key[3] for key in rows)
    assert_matches_reference(rows, reference_run(adamw_torch), 12)


@pytest.mark.parametrize("kind", ["Adam", "experimental.Adam",
                                  pytest.param("mindformers.AdamW", marks=pytest.mark.mindformers)])
def test_moments_of_other_optimizers(tmp_path, output_root, kind):
    """Before step 1 every Adam keeps m = (1 - b1) g0 and v = (1 - b2) g0^2 of the step-0 gradient,
    whatever its update rule."""
    msprobe_loop(TrainerMon, write_config(tmp_path, OPTIMIZER_STATE), kind, steps=2)
    rows = csv_rows(run_folder(output_root))
    reference = reference_run(steps=1)
    for name in NAMES:
        g0 = reference[("grad_reduced", 0, None, name)]
        expected = {("exp_avg", 0, None, name): np.zeros_like(g0), ("exp_avg_sq", 0, None, name): np.zeros_like(g0),
                    ("exp_avg", 1, None, name): (1 - BETA1_F32) * g0,
                    ("exp_avg_sq", 1, None, name): (1 - BETA2_F32) * g0 * g0}
        assert_matches_reference({key: rows[key] for key in expected}, expected, 6)


def test_step_selection_and_files_per_record(tmp_path, output_root):
    config = dict(WEIGHTS, start_step=1, step_interval=1, collect_times=2, step_count_per_record=2)
    msprobe_loop(TrainerMon, write_config(tmp_path, config), steps=STEPS)
    folder = run_folder(output_root)
    assert sorted(os.listdir(folder)) == ["param_origin_0-1.csv", "param_origin_2-3.csv",
                                          "param_updated_0-1.csv", "param_updated_2-3.csv"]
    rows = csv_rows(folder)
    assert {key[1] for key in rows} == {1, 2}
    assert_matches_reference(rows, reference_run(), 6)


def test_targets_select_modules_and_parameters(tmp_path, output_root):
    config = dict(WEIGHT_GRADIENTS, targets={"fc1": {}, "fc2.bias": {}})
    msprobe_loop(TrainerMon, write_config(tmp_path, config), steps=1)
    rows = csv_rows(run_folder(output_root))
    assert {key[3] for key in rows} == {"fc1.weight", "fc1.bias", "fc2.bias"}


def test_generate_wgrad_metrics(tmp_path, output_root):
    monitor = msprobe_loop(TrainerMon, write_config(tmp_path, WEIGHT_GRADIENTS), steps=1)
    assert monitor.generate_wgrad_metrics() == ({}, {})  # msprobe loop: nothing in param.grad, sums cleared
    monitor = main_grad_loop(TrainerMon, write_config(tmp_path, WEIGHT_GRADIENTS), steps=1)
    reduced, unreduced = monitor.generate_wgrad_metrics()
    expected = reference_run(steps=1)[("grad_reduced", 0, None, "fc2.weight")]
    assert math.isclose(reduced["fc2.weight"]["norm"], statistic(expected, "norm"), rel_tol=RTOL)
    assert unreduced == {}


def test_deprecated_entry_points(tmp_path, output_root):
    import mindspore as ms
    from tests.support.msprobe_reference import make_model, make_optimizer

    monitor = TrainerMon(write_config(tmp_path, WEIGHTS), params_have_main_grad=False)
    model = make_model()
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    with pytest.warns(DeprecationWarning, match="set_wrapped_optimizer"):
        monitor.set_wrapped_optimizer(optimizer)
    with pytest.warns(DeprecationWarning, match="set_monitor"):
        monitor.monitor_gnorm_with_ad(model, grad_acc_steps=K)
    with pytest.warns(DeprecationWarning, match="ops"):
        monitor.ops = ["max"]
    assert monitor.ops == ("max",)
    optimizer(tuple(ms.ops.zeros_like(p) for p in optimizer.parameters))
    records = read_csv(os.path.join(run_folder(output_root), "param_origin_0-0.csv"))
    assert records[0].ops == ("max",) and records[0].value[0] == pytest.approx(initial_weights()["fc1.weight"].max())


def test_hooks_are_per_instance(tmp_path, output_root):
    from tests.support.msprobe_reference import make_model, make_optimizer

    model = make_model()
    watched = make_optimizer("AdamWeightDecay", model.trainable_params())
    other = make_optimizer("AdamWeightDecay", make_model().trainable_params())
    monitor = TrainerMon(write_config(tmp_path, WEIGHTS), params_have_main_grad=False)
    monitor.set_monitor(model, K, watched)
    import mindspore as ms
    other(tuple(ms.ops.zeros_like(p) for p in other.parameters))
    assert not os.path.exists(output_root)   # the other instance is not monitored: nothing written
    assert type(watched).__call__ is type(other).__call__ and "construct" not in vars(watched)
    monitor.close()
    watched(tuple(ms.ops.zeros_like(p) for p in watched.parameters))
    assert not os.path.exists(output_root)   # detached


def test_optimizer_without_moments_is_named(tmp_path, output_root):
    from mindspore import nn
    from mindmon.config import ConfigError
    from tests.support.msprobe_reference import make_model

    model = make_model()
    monitor = TrainerMon(write_config(tmp_path, OPTIMIZER_STATE))
    with pytest.raises(ConfigError, match="mv_distribution.*SGD"):
        monitor.set_monitor(model, K, nn.SGD(model.trainable_params(), 0.1))


def test_run_folder_uses_local_time(tmp_path, output_root):
    from datetime import datetime

    before = datetime.now().replace(microsecond=0)
    msprobe_loop(TrainerMon, write_config(tmp_path, WEIGHTS), steps=1)
    stamp = os.path.basename(run_folder(output_root)).split("-rank0-")[0]
    written = datetime.strptime(stamp, "%b%d_%H-%M-%S").replace(year=before.year)
    assert 0 <= (written - before).total_seconds() <= 60


def test_gradients_reference_is_the_sum_of_micro_batches():
    """The reference itself: summed micro-batch gradients equal the gradient of the whole batch's loss."""
    w = {n: a.astype(np.float64) for n, a in initial_weights().items()}
    (x0, y0), (x1, y1) = batches()[0]
    full = gradients(w, np.concatenate([x0, x1]), np.concatenate([y0, y1]))
    parts = [gradients(w, x0, y0), gradients(w, x1, y1)]
    for name in NAMES:  # loss_k / K over half the samples each = the full batch's mean loss
        np.testing.assert_allclose(parts[0][name] + parts[1][name], full[name] * K, rtol=1e-12)


class DeviceTrainerMon(TrainerMon):
    """The path taken off CPU (statistics reduced by MindSpore ops, one transfer per step), run on CPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_host = False


@pytest.mark.parametrize("config", [EVERYTHING, dict(EVERYTHING, monitor_mbs_grad=True)], ids=["summed", "mbs"])
def test_device_path_matches_numpy(tmp_path, output_root, config):
    msprobe_loop(DeviceTrainerMon, write_config(tmp_path, config))
    rows = csv_rows(run_folder(output_root))
    prefixes = ("param_origin", "param_updated", "grad_reduced", "exp_avg", "exp_avg_sq")
    micro = config.get("monitor_mbs_grad", False)
    assert set(rows) == expected_keys(prefixes) | expected_keys(["grad_unreduced"], micro=micro)
    assert_matches_reference(rows, reference_run(), 12)


def test_output_failure_is_logged_once_and_training_goes_on(tmp_path, output_root, caplog):
    class BrokenFolder(TrainerMon):
        def set_monitor(self, *args, **kwargs):
            super().set_monitor(*args, **kwargs)
            os.makedirs(os.path.dirname(self.sink.folder), exist_ok=True)
            open(self.sink.folder, "w").close()   # a file where the run folder goes: every write fails

    with caplog.at_level(logging.WARNING, logger="mindmon"):
        monitor = msprobe_loop(BrokenFolder, write_config(tmp_path, WEIGHTS))
    assert monitor.step == STEPS
    failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1 and "MsprobeCsvSink failed" in failures[0] and "switched off" in failures[0]


def test_from_config_feeds_extra_sinks(tmp_path, output_root):
    from mindmon.core.engine import Sink
    from mindmon.msprobe import parse_tensor_stats

    class Collect(Sink):
        def __init__(self):
            self.records, self.flushes = [], 0

        def write(self, records):
            self.records += records

        def flush(self):
            self.flushes += 1

    collected = Collect()
    config = parse_tensor_stats({"wg_distribution": True, "ops": ["norm"]}, "monitor.tensor_stats")
    msprobe_loop(lambda path, params_have_main_grad: TrainerMon.from_config(config, [collected], False),
                 write_config(tmp_path, {}))
    assert collected.flushes == STEPS and len(collected.records) == 2 * len(NAMES) * STEPS
    first = json.loads(jsonl.encode(collected.records[0]))
    assert first["kind"] in ("grad_reduced", "grad_unreduced") and first["ops"] == ["norm"] and first["step"] == 1
    assert set(csv_rows(run_folder(output_root))) == expected_keys(["grad_reduced", "grad_unreduced"])


def test_generate_wgrad_metrics_inside_a_step(tmp_path, output_root):
    import mindspore as ms
    from mindspore import nn, value_and_grad
    from tests.support.msprobe_reference import make_model, make_optimizer

    model = make_model()
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    monitor = TrainerMon(write_config(tmp_path, WEIGHT_GRADIENTS), params_have_main_grad=False)
    monitor.set_monitor(model, K, optimizer)
    loss_fn = nn.MSELoss()
    grad_fn = value_and_grad(lambda x, y: loss_fn(model(x), y) / K, None, optimizer.parameters)
    for x, y in batches()[0]:
        grad_fn(ms.Tensor(x), ms.Tensor(y))
    reduced, unreduced = monitor.generate_wgrad_metrics()
    assert reduced == {}   # nothing in param.grad: only the optimizer call will see the reduced gradients
    reference = reference_run(steps=1)
    for name in NAMES:
        expected = reference[("grad_unreduced", 0, None, name)]
        assert set(unreduced[name]) == {"min", "max", "mean", "norm"}
        assert math.isclose(unreduced[name]["norm"], statistic(expected, "norm"), rel_tol=RTOL)


def test_gradient_sums_memory_is_given_back_when_monitoring_stops(tmp_path, output_root):
    """The host sums of the gradients are kept from step to step while collecting (their values are
    checked by the tests above over several steps) and released once collect_times is reached."""
    config = dict(WEIGHT_GRADIENTS, collect_times=2)
    monitor = msprobe_loop(TrainerMon, write_config(tmp_path, config), steps=1)
    assert len(monitor.hooks.gradient_sums._buffers) == len(NAMES)   # step 0 collected, step 1 will be: one per parameter
    monitor.close()
    monitor = msprobe_loop(TrainerMon, write_config(tmp_path, config), steps=2)
    assert monitor.hooks.gradient_sums._buffers == {}                # steps 0 and 1 collected: collect_times reached


def test_gradient_hooks_become_appends_after_the_first_micro_batch(tmp_path, output_root):
    """After the first collected step every gradient hook but the closer's is a list's append (where
    MindSpore takes built-in hooks); the values of the steps after it are checked against numpy above."""
    from mindmon.compat import builtin_hooks_accepted

    monitor = msprobe_loop(TrainerMon, write_config(tmp_path, WEIGHT_GRADIENTS), steps=2)
    hooks = monitor.hooks
    if not builtin_hooks_accepted():   # MindSpore 2.7: Python hooks only
        assert hooks._hooked_closer is None
        return
    # a backward pass gives the first layer's gradients last: one of them closes the micro-batch
    assert hooks.gradient_sums.closer == hooks._hooked_closer and NAMES[hooks._hooked_closer].startswith("fc1.")
    rows = csv_rows(run_folder(output_root))
    assert_matches_reference({key: row for key, row in rows.items() if key[1] == 1}, reference_run(), 16)


def test_python_gradient_hooks_where_built_in_ones_are_refused(tmp_path, output_root, monkeypatch):
    """Where MindSpore refuses a built-in hook (2.7), every gradient hook stays Python: the same numbers."""
    from mindmon.features.tensor_stats import hooks as tensor_stats_hooks

    monkeypatch.setattr(tensor_stats_hooks, "builtin_hooks_accepted", lambda: False)
    monitor = msprobe_loop(TrainerMon, write_config(tmp_path, WEIGHT_GRADIENTS))
    assert monitor.hooks._hooked_closer is None and monitor.hooks.gradient_sums.closer is not None
    rows = csv_rows(run_folder(output_root))
    assert set(rows) == expected_keys(("grad_reduced", "grad_unreduced"))
    assert_matches_reference(rows, reference_run(), 16)
