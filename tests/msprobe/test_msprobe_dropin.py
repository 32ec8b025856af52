"""msprobe's own scripts on mindmon's TrainerMon unchanged: `set_monitor` in both argument orders, an
empty alert rule list, and `mindmon anomalies` ordering a dump msprobe's MindSpore monitor wrote as
msprobe's analyser orders it."""
import json

import numpy as np
import pytest

from tests.support.msprobe_reference import K, NAMES, STEPS, make_model, make_optimizer, reference_run, statistic, train_steps
from mindmon.config import ConfigError
from mindmon.msprobe import TrainerMon
from mindmon.msprobe.trainer_mon import set_monitor_arguments

MICRO_BATCH_GRADIENTS = {"wg_distribution": True, "monitor_mbs_grad": True, "ops": ["min", "max", "norm"],
                         "ndigits": 12}


@pytest.fixture
def output_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "monitor_output"))
    return tmp_path / "monitor_output"


def write_config(tmp_path, config) -> str:
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def micro_batch_rows(root):
    from tests.msprobe.test_msprobe_trainer_mon import csv_rows, run_folder

    return {key: record for key, record in csv_rows(run_folder(root)).items() if key[0] == "grad_unreduced"}


@pytest.mark.parametrize("call", ["msprobe_positional", "msprobe_keywords", "documented_positional"])
def test_set_monitor_takes_both_argument_orders(tmp_path, output_root, call):
    """grad_acc_steps = K = 2 reaches the monitor in every order: one row per micro-batch 0..K-1, each the
    numpy gradient of that micro-batch."""
    model = make_model()
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    monitor = TrainerMon(write_config(tmp_path, MICRO_BATCH_GRADIENTS), params_have_main_grad=False)
    if call == "msprobe_positional":
        monitor.set_monitor(model, optimizer, K, None, None, 0)
    elif call == "msprobe_keywords":
        monitor.set_monitor(model, optimizer, grad_acc_steps=K)
    else:
        monitor.set_monitor(model, K, optimizer)
    train_steps(model, optimizer, STEPS)
    monitor.close()
    rows = micro_batch_rows(output_root)
    reference = reference_run()
    assert set(rows) == {("grad_unreduced", s, k, n) for s in range(STEPS) for k in range(K) for n in NAMES}
    for key, record in rows.items():
        for op, value in zip(record.ops, record.value):
            want = statistic(reference[key], op)
            assert abs(value - want) <= 1e-5 * abs(want) + 1e-12, (key, op, value, want)


def test_msprobe_order_puts_tp_group_before_dp_group():
    optimizer = make_optimizer("AdamWeightDecay", make_model().trainable_params())
    got = set_monitor_arguments((optimizer, 4, "tp", "dp", 7), {})
    assert (got["optimizer"], got["grad_acc_steps"], got["tp_group"], got["dp_group"], got["start_iteration"]) == \
        (optimizer, 4, "tp", "dp", 7)
    got = set_monitor_arguments((4, optimizer, "dp", "tp"), {})
    assert (got["grad_acc_steps"], got["dp_group"], got["tp_group"], got["start_iteration"]) == (4, "dp", "tp", 0)
    assert set_monitor_arguments((optimizer,), {})["grad_acc_steps"] == 1


@pytest.mark.parametrize("args, kwargs, message", [
    ((1, 2, 3, 4, 5, 6), {}, "set_monitor: got 7 positional arguments"),
    ((2,), {"optimiser": None}, "set_monitor: got the keyword 'optimiser'"),
    ((2,), {}, "set_monitor: optimizer missing"),
])
def test_set_monitor_refuses_arguments_in_one_line(args, kwargs, message):
    with pytest.raises(ConfigError) as error:
        set_monitor_arguments(args, kwargs)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_an_empty_alert_rule_list_is_accepted(tmp_path, output_root):
    """msprobe's default alert block: no rules, no dump; the statistics still run (grad_reduced = numpy)."""
    config = {"wg_distribution": True, "ops": ["norm"], "ndigits": 12, "alert": {"rules": [], "dump": False}}
    model = make_model()
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    monitor = TrainerMon(write_config(tmp_path, config), params_have_main_grad=False)
    assert not monitor.config.alert.active
    monitor.set_monitor(model, optimizer, K)
    train_steps(model, optimizer, 1)
    monitor.close()
    from tests.msprobe.test_msprobe_trainer_mon import csv_rows, run_folder

    rows = csv_rows(run_folder(output_root))
    want = np.sqrt((reference_run()[("grad_reduced", 0, None, "fc1.weight")] ** 2).sum())
    assert abs(rows[("grad_reduced", 0, None, "fc1.weight")].value[0] - want) <= 1e-6 * want
    assert not (output_root / "anomaly_detected").exists()


def test_an_empty_alert_rule_list_still_checks_its_other_keys(tmp_path):
    path = write_config(tmp_path, {"wg_distribution": True, "alert": {"rules": [], "dump": "no"}})
    with pytest.raises(ConfigError) as error:
        TrainerMon(path)
    assert str(error.value) == "alert.dump: got 'no' (str); allowed: True or False"


# --- `mindmon anomalies` on msprobe's dumps ---------------------------------------------------------

def msprobe_entry(tag, vpp_stage=0, pp_stage=0, step=3, micro_step=1, call_id=0):
    return {"rank": 0, "step": step, "micro_step": micro_step, "pp_stage": pp_stage, "vpp_stage": vpp_stage,
            "call_id": call_id, "tag_name": tag, "message": tag, "group_mates": [0]}


def analysed_order(tmp_path, entries):
    from mindmon.cli import main

    folder = tmp_path / "anomaly_detected"
    (folder / "rank0").mkdir(parents=True)
    (folder / "rank0" / "anomaly.json").write_text(json.dumps(entries))
    assert main(["anomalies", "-d", str(folder), "-k", "50"]) == 0
    return list(json.loads((folder / "anomaly_analyse.json").read_text()))


def test_a_mindspore_dump_is_ordered_as_msprobe_orders_it(tmp_path):
    """Six entries of one step and micro-step, as msprobe's MindSpore monitor names them. msprobe 26.2.0's
    analyser gives: the parameter before the update (a point it has no stage for), the forward chunk by
    chunk, the gradients from the last chunk back, then Adam's moment."""
    entries = {
        "B": msprobe_entry("1:fc1.input:1/rank0/actv", vpp_stage=1, call_id=4),
        "D": msprobe_entry("1:fc1.weight/rank0/post_grad", vpp_stage=1, call_id=9),
        "A": msprobe_entry("0:fc1.input:1/rank0/actv", vpp_stage=0, call_id=1),
        "C": msprobe_entry("0:fc1.weight/rank0/post_grad", vpp_stage=0, call_id=12),
        "F": msprobe_entry("0:fc1.weight/rank0/param_origin", vpp_stage=0, call_id=15),
        "E": msprobe_entry("0:fc1.weight/rank0/exp_avg", vpp_stage=0, call_id=14),
    }
    assert analysed_order(tmp_path, entries) == ["F", "A", "B", "D", "C", "E"]


@pytest.mark.parametrize("point, earlier_first", [
    ("actv", True),          # forward: chunk 0 runs before chunk 1
    ("post_grad", False),    # backward: chunk 1's gradients come first
    ("actv_grad", False),
    ("acc_grad", False),
])
def test_chunks_of_one_point_run_forward_up_and_backward_down(tmp_path, point, earlier_first):
    """msprobe's rule for two entries that differ only in vpp_stage (and, the same way, in pp_stage)."""
    for stage_key in ("vpp_stage", "pp_stage"):
        low = msprobe_entry(f"0:layer/rank0/{point}", **{stage_key: 0})
        high = msprobe_entry(f"1:layer/rank0/{point}", **{stage_key: 1})
        order = analysed_order(tmp_path / stage_key / point, {"high": high, "low": low})
        assert order == (["low", "high"] if earlier_first else ["high", "low"]), (stage_key, point)


def test_the_forward_of_a_later_stage_comes_before_a_gradient_of_an_earlier_one(tmp_path):
    """The phase decides before the stage: a forward entry on stage 1 precedes a gradient on stage 0,
    whichever of vpp_stage or pp_stage it is."""
    for stage_key in ("vpp_stage", "pp_stage"):
        forward = msprobe_entry("1:layer/rank0/actv", **{stage_key: 1})
        gradient = msprobe_entry("0:layer/rank0/post_grad", **{stage_key: 0})
        assert analysed_order(tmp_path / stage_key, {"g": gradient, "f": forward}) == ["f", "g"]


def test_steps_and_micro_steps_decide_before_the_phase(tmp_path):
    entries = {"late_step": msprobe_entry("0:a/rank0/param_origin", step=4, micro_step=0),
               "late_micro": msprobe_entry("0:a/rank0/actv", step=3, micro_step=2),
               "first": msprobe_entry("0:a/rank0/exp_avg_sq", step=3, micro_step=1)}
    assert analysed_order(tmp_path, entries) == ["first", "late_micro", "late_step"]
