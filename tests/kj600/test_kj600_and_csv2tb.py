"""kj600's entry points (hook_modules, set_wrapped_optimizer, KJ600_OUTPUT_DIR, its config keys) writing
TensorBoard, and msprobe's csv2tensorboard_by_step / `mindmon csv2tensorboard`; every value read back
with TensorBoard's EventAccumulator and compared with the float64 numpy recomputation."""
import glob
import logging
import math
import os
import re
import socket

import pytest

from tests.support.activations_reference import activation_rows, output_root_for, run_config, train
from tests.support.msprobe_reference import K, reference_run, statistic
from mindmon.cli import main
from mindmon.kj600.module_hook import TrainerMon as Kj600TrainerMon
from mindmon.msprobe import csv2tensorboard_by_step

KJ600_CONFIG = {
    "targets": {"fc1": {"input": "tuple[1]:0", "output": "tensor", "input_grad": "tuple[1]:0",
                        "output_grad": "tuple[1]:0"}},
    "print_struct": False, "module_ranks": [0], "ur_distribution": False, "xy_distribution": True,
    "mv_distribution": False, "wg_distribution": False, "cc_distribution": {"enable": False, "cc_codeline": []},
    "ops": ["min", "max", "norm", "zeros", "id"], "eps": 1e-8, "opt_ty": "Megatron_DistributedOptimizer"}
STEPS = 2


def scalars(event_dir):
    """{tag: {x: value}} of one event directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(event_dir)
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def assert_close(value, want, rtol=1e-6, atol=1e-12):
    if math.isnan(want):
        assert math.isnan(value)
    else:
        assert abs(value - want) <= rtol * abs(want) + atol, (value, want)


@pytest.fixture
def output_root(tmp_path, monkeypatch):
    monkeypatch.setenv("KJ600_OUTPUT_DIR", str(tmp_path / "kj600"))
    return output_root_for(tmp_path, monkeypatch)


def kj600_run(tmp_path, config, optimizer=False):
    import json

    path = tmp_path / "llama2_config.json"
    path.write_text(json.dumps(config))

    def make():
        return Kj600TrainerMon(str(path), params_have_main_grad=False, opt_ty="Megatron_DistributedOptimizer")

    monitor = train(make, STEPS, optimizer_to_monitor=False, wrap_optimizer=optimizer)
    monitor.close()
    (events,) = glob.glob(str(tmp_path / "kj600" / "*-rank0-*"))
    # kj600's run folder holds the event file itself (no rank_<r> folder inside), named as PyTorch's writer
    # names its files: events.out.tfevents.<time>.<host>.<pid>.<n>
    (event_file,) = [n for n in os.listdir(events) if n.startswith("events.out.tfevents.")]
    assert re.fullmatch(rf"events\.out\.tfevents\.\d+\.{re.escape(socket.gethostname())}\.{os.getpid()}\.\d+", event_file)
    assert not glob.glob(os.path.join(events, "rank_*"))
    return scalars(events)


def test_kj600_hook_modules_writes_activations_to_tensorboard(tmp_path, output_root, caplog):
    """msprobe's spelling: `0:<cell>.<input|output>:<micro_step>/rank0/<actv|actv_grad>_<op>`, against the
    0-based step."""
    with caplog.at_level(logging.INFO, logger="mindmon"):
        tags = kj600_run(tmp_path, KJ600_CONFIG)
    reference = activation_rows(STEPS)
    expected = {f"0:fc1.{io}:{micro}/rank0/{kind}_{op}"
                for kind, io in (("actv", "input"), ("actv", "output"), ("actv_grad", "output"))
                for micro in range(K) for op in KJ600_CONFIG["ops"]}
    assert set(tags) == expected   # fc1's input gradient is None (x is not differentiated): no tag
    for tag, points in tags.items():
        match = re.fullmatch(r"0:(fc1\.\w+):(\d)/rank0/(actv_grad|actv)_(min|max|norm|zeros|id)", tag)
        name, micro, kind, op = match.group(1), int(match.group(2)), match.group(3), match.group(4)
        assert sorted(points) == list(range(STEPS))   # x = the 0-based step
        for step, value in points.items():
            array = reference[(kind, step, micro, name)]
            assert_close(value, float("nan") if op == "id" else statistic(array, op))
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "opt_ty" in messages and "ignored" in messages and "> 1 out of 4 modules are monitored." in messages


def test_kj600_wrapped_optimizer_adds_weight_gradients(tmp_path, output_root):
    """grad_reduced is msprobe's post_grad, grad_unreduced its acc_grad."""
    config = dict(KJ600_CONFIG, targets={}, xy_distribution=False, wg_distribution=True, ops=["norm"])
    tags = kj600_run(tmp_path, config, optimizer=True)
    reference = reference_run(steps=STEPS)
    names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    assert set(tags) == {f"0:{n}/rank0/{point}_norm" for n in names for point in ("post_grad", "acc_grad")}
    for name in ("fc1.weight", "fc2.bias"):
        for point, kind in (("post_grad", "grad_reduced"), ("acc_grad", "grad_unreduced")):
            points = tags[f"0:{name}/rank0/{point}_norm"]
            assert sorted(points) == [0, 1]   # per step, from 0
            for step, value in points.items():
                assert_close(value, statistic(reference[(kind, step, None, name)], "norm"))


def test_csv2tensorboard_by_step_and_command(tmp_path, output_root, capsys):
    run_config(tmp_path, {"xy_distribution": True, "wg_distribution": True, "ops": ["norm", "max"],
                          "ndigits": 12}, steps=STEPS)
    (folder,) = glob.glob(str(output_root / "*-rank0-*"))
    stamp = re.match(r"(.*)-rank0-", os.path.basename(folder)).group(1)
    written = csv2tensorboard_by_step(str(output_root), stamp, stamp, data_type_list=["actv", "grad_reduced"],
                                      output_dirpath=str(tmp_path / "tb"))
    # msprobe's layout: rank<r>/<data type>/, tags vp<stage>:<name>[:micro<m>]/<op>, the CSV's 0-based step
    assert sorted(written) == [str(tmp_path / "tb" / "rank0" / kind) for kind in ("actv", "grad_reduced")]
    reference = {**activation_rows(STEPS), **reference_run(steps=STEPS)}
    for directory in written:
        kind = os.path.basename(directory)
        tags = scalars(directory)
        assert tags and all(tag.startswith("vp0:") for tag in tags)
        for tag, points in tags.items():
            row, op = tag.rsplit("/", 1)
            parts = row[len("vp0:"):].split(":micro")
            name, micro = parts[0], (int(parts[1]) if len(parts) == 2 else None)
            assert (micro is not None) == (kind == "actv")
            assert sorted(points) == list(range(STEPS))
            for step, value in points.items():
                assert_close(value, statistic(reference[(kind, step, micro, name)], op))
    assert main(["csv2tensorboard", str(output_root), stamp, stamp, "--data-type", "actv_grad",
                 "-o", str(tmp_path / "tb2")]) == 0
    assert str(tmp_path / "tb2" / "rank0" / "actv_grad") in capsys.readouterr().out
    assert all(t.startswith("vp0:") and ":micro" in t for t in scalars(str(tmp_path / "tb2" / "rank0" / "actv_grad")))
    assert main(["csv2tensorboard", str(output_root), "Jan01_00-00-00", "Jan01_00-00-01"]) == 1
    with pytest.raises(ValueError, match="data_type_list: got 'weights'"):
        csv2tensorboard_by_step(str(output_root), stamp, stamp, data_type_list=["weights"])
