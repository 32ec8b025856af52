"""msprobe's spelling through the msprobe and kj600 front doors: TensorBoard tags
`0:<name>[:<micro_step>]/rank<r>/<point>_<op>` against the 0-based step, the same tag names in the anomaly
dump, the YAML route's own `<kind>/<name>` kept; and msprobe's `format: "api"` (no files, the numbers
through generate_wgrad_metrics). Tags are written out literally here, TensorBoard files are read back with
TensorBoard's reader and every value is compared with the float64 numpy run of msprobe_reference."""
import glob
import json
import os

import pytest

from tests.support.msprobe_reference import K, NAMES, STEPS, make_model, make_optimizer, msprobe_loop, reference_run, statistic, train_steps
from mindmon.config import ConfigError
from mindmon.formats.msprobe_tags import MsprobeTag, format_tag, msprobe_csv_name, read_tag, tag_name
from mindmon.msprobe import TrainerMon, parse_tensor_stats
from mindmon.sinks.tensorboard import msprobe_tensorboard_sink

# mindmon's point -> msprobe's, as msprobe 26.2's monitor names them
POINTS = {"param_origin": "param_origin", "param_updated": "param_updated", "grad_unreduced": "acc_grad",
          "grad_reduced": "post_grad", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
OPS = ["min", "max", "mean", "norm"]


def scalars(event_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(event_dir)
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def close(value, want, rtol=1e-5, atol=1e-7):
    return abs(value - want) <= rtol * abs(want) + atol


def api_run(tmp_path, section, before_update=None):
    """The msprobe loop with `format: "api"` and msprobe's TensorBoard sink; its event directory."""
    config = parse_tensor_stats(dict(section, format="api"))
    monitor = TrainerMon.from_config(config, sinks=[msprobe_tensorboard_sink(str(tmp_path / "tb"))],
                                     params_have_main_grad=False)
    model = make_model()
    model.set_train(True)
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    train_steps(model, optimizer, before_update=before_update and (lambda summed: before_update(monitor)))
    monitor.close()
    return str(tmp_path / "tb" / "rank_0")


def test_tag_names_both_ways():
    assert tag_name("grad_reduced", "fc1.weight", None, 0) == "0:fc1.weight/rank0/post_grad"
    assert tag_name("grad_unreduced", "fc1.weight", 1, 3) == "0:fc1.weight:1/rank3/acc_grad"
    assert tag_name("actv", "fc1.input_0", 0, 0) == "0:fc1.input_0:0/rank0/actv"
    assert tag_name("adam_update_histogram", "fc2.bias", None, 0) == "0:fc2.bias/rank0/adam_update"
    assert tag_name("loss", "loss", None, 0) is None
    assert tag_name("grad_reduced", "1:layers.0.weight", None, 2) == "1:layers.0.weight/rank2/post_grad"   # chunk 1
    # L2 features: the tensor they are computed from (msprobe's qkt, sr)
    assert tag_name("attention_hook", "core.attention", 1, 0) == "0:core.attention:1/rank0/qkt"
    assert tag_name("linear_hook", "wq.linear", None, 3) == "0:wq.linear/rank3/sr"
    assert read_tag("0:core.attention:1/rank0/qkt_softmax_max") == \
        MsprobeTag(0, "core.attention", 1, 0, "qkt", "softmax_max")
    assert read_tag("0:wq.linear/rank3/sr_kernel_norm").kind == "linear_hook"
    # collectives: <function>/rank<r>/<pre|post>_<call>_<tensor>
    assert tag_name("cc_pre", "AllReduce.train.py[28].3.input", None, 1) == "AllReduce/rank1/pre_3_0"
    assert tag_name("cc_post", "comm_func.all_reduce.my.train.py[9].0.output_1", None, 0) == \
        "all_reduce/rank0/post_0_1"
    assert tag_name("cc_post", "not a row", None, 0) is None
    assert read_tag("0:fc1.output:1/rank0/actv_grad_norm") == MsprobeTag(0, "fc1.output", 1, 0, "actv_grad", "norm")
    assert read_tag("0:fc1.weight/rank2/exp_avg_sq_min") == MsprobeTag(0, "fc1.weight", None, 2, "exp_avg_sq", "min")
    assert read_tag("0:fc1.weight/rank2/exp_avg_min").kind == "exp_avg"
    assert read_tag("0:fc1.weight/rank0/post_grad").kind == "grad_reduced"
    assert read_tag("grad_reduced/fc1.weight/norm") is None
    # the collectives: read back, and msprobe's CSV name of the row
    assert read_tag("AllReduce/rank1/pre_3_0_norm") == MsprobeTag(None, "AllReduce", None, 1, "pre", "norm", 3, 0)
    assert read_tag("all_reduce/rank0/post_0_1").kind == "cc_post"
    for tag in ("AllReduce/rank1/pre_3_0_norm", "all_reduce/rank0/post_0_1", "0:fc1.output:1/rank0/actv_grad_norm",
                "1:layers.0.weight/rank2/post_grad", "0:core.attention:1/rank0/qkt_entropy_mean"):
        assert format_tag(read_tag(tag)) == tag
    assert msprobe_csv_name("comm_func.all_reduce.my.train.py[9].0.output_1") == "all_reduce.output"
    assert msprobe_csv_name("AllGather.train.py[28].3.input") == "AllGather.input"


def test_api_format_writes_no_files_and_msprobe_tensorboard_tags(tmp_path, monkeypatch):
    """`format: "api"`: no CSV file, the numbers through generate_wgrad_metrics (checked in the loop before
    every update); a TensorBoard sink handed to TrainerMon.from_config in msprobe's spelling."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    reference = reference_run()
    seen = []

    def before_update(monitor):
        step = len(seen)
        _, unreduced = monitor.generate_wgrad_metrics()
        for name in NAMES:
            for op in OPS:
                want = statistic(reference[("grad_unreduced", step, None, name)], op)
                assert close(unreduced[name][op], want), (name, op, step)
        seen.append(step)

    events = api_run(tmp_path, {"param_distribution": True, "wg_distribution": True, "mv_distribution": True,
                                "ops": OPS}, before_update)
    assert seen == list(range(STEPS))
    assert not glob.glob(str(tmp_path / "out" / "**" / "*.csv"), recursive=True)
    tags = scalars(events)
    assert set(tags) == {f"0:{name}/rank0/{point}_{op}" for name in NAMES for point in POINTS.values()
                         for op in OPS}
    for kind, point in POINTS.items():
        for name in NAMES:
            for op in OPS:
                points = tags[f"0:{name}/rank0/{point}_{op}"]
                assert sorted(points) == list(range(STEPS))
                for step, value in points.items():
                    want = statistic(reference[(kind, step, None, name)], op)
                    assert close(value, want), (kind, name, op, step, value, want)


def test_per_micro_batch_gradients_carry_the_micro_step(tmp_path):
    """monitor_mbs_grad: one tag per micro-batch, `0:fc1.weight:<k>/rank0/acc_grad_norm`."""
    tags = scalars(api_run(tmp_path, {"wg_distribution": True, "monitor_mbs_grad": True, "ops": ["norm"]}))
    reference = reference_run()
    expected = {f"0:{name}:{k}/rank0/acc_grad_norm" for name in NAMES for k in range(K)} | \
        {f"0:{name}/rank0/post_grad_norm" for name in NAMES}
    assert set(tags) == expected
    for name in NAMES:
        for k in range(K):
            for step, value in tags[f"0:{name}:{k}/rank0/acc_grad_norm"].items():
                assert close(value, statistic(reference[("grad_unreduced", step, k, name)], "norm"))


def dump_entries(root):
    (dump,) = glob.glob(os.path.join(root, "anomaly_detected", "rank0", "anomaly.json"))
    with open(dump) as handle:
        return list(json.load(handle).values())


def test_dump_tag_names_in_msprobe_spelling(tmp_path, monkeypatch):
    """AnomalyNan with a threshold fires on every |norm| above it: the dump names each by msprobe's tag
    name, its step 0-based, its value numpy's."""
    root = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(root))
    threshold = 0.05
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"wg_distribution": True, "mv_distribution": True, "ops": ["norm"],
                                "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": threshold}}],
                                          "dump": True}}))
    msprobe_loop(TrainerMon, str(path)).close()
    reference = reference_run()
    expected = {(f"0:{name}/rank0/{POINTS[kind]}", step): statistic(reference[(kind, step, None, name)], "norm")
                for kind in ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq") for name in NAMES
                for step in range(STEPS) if statistic(reference[(kind, step, None, name)], "norm") > threshold}
    assert len(expected) > 10
    entries = dump_entries(str(root))
    got = {(e["tag_name"], e["step"]): e["value"] for e in entries}
    assert set(got) == set(expected)
    for key, value in got.items():
        assert close(value, expected[key]), key
    entry = next(e for e in entries if e["tag_name"] == "0:fc1.weight/rank0/post_grad")
    assert "('0:fc1.weight/rank0/post_grad', 'norm')" in entry["message"] and entry["statistic"] == "norm"


def test_yaml_route_keeps_mindmons_tag_names(tmp_path):
    """The YAML route (mindmon's dialect): `<kind>/<name>` in the dump, steps from 1."""
    from mindmon import build_group, parse_sections
    from mindmon.core.records import TensorStatsRecord

    section = {"wg_distribution": True, "ops": ["norm"]}
    config = parse_sections({"monitor": {"output_dir": str(tmp_path / "mon"), "tensor_stats": section,
                                         "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1.0}}],
                                                   "dump": True}}})
    group = build_group(config, rank=0)
    group.setup()
    group.write([TensorStatsRecord(1, None, 0, "grad_reduced", "fc1.weight", [2.5], ops=("norm",))])
    group.close()
    (entry,) = dump_entries(str(tmp_path / "mon"))
    assert (entry["tag_name"], entry["step"], entry["value"]) == ("grad_reduced/fc1.weight", 1, 2.5)


def test_format_is_csv_or_api():
    assert parse_tensor_stats({"format": "api"}).format == "api"
    with pytest.raises(ConfigError, match=r"^format: got 'tensorboard' \(str\); allowed: 'csv' or 'api'"):
        parse_tensor_stats({"format": "tensorboard"})
