"""print_struct (module_struct.json, then training stops after step 1), stack_info (stack_info.csv),
monitor_mbs_grad beside activations, on real MindSpore."""
import csv
import glob
import inspect
import json
import os

import pytest

from tests.support import REPO, activations_reference
from tests.support.activations_reference import output_root_for, run_config
from mindmon.features.tensor_stats.structure import StopTraining


@pytest.fixture
def output_root(tmp_path, monkeypatch):
    return output_root_for(tmp_path, monkeypatch)


run = run_config


def tensor(*shape):
    return f"size={shape}, dtype=Float32"


def test_print_struct_writes_every_cell_then_stops_after_step_1(tmp_path, output_root):
    steps_done = []
    with pytest.raises(StopTraining) as stop:
        run(tmp_path, {"print_struct": True, "wg_distribution": True}, steps=3, between_steps=steps_done.append)
    path = output_root / "module_struct" / "rank0" / "module_struct.json"
    assert stop.value.code == 0 and str(path) in str(stop.value) and steps_done == []
    struct = json.loads(path.read_text())
    assert list(struct) == ["", "fc1", "fc2", "act"]
    assert struct["fc1"] == {"input": {"config": "tuple[1]", "0": tensor(4, 4)},
                             "output": {"config": "tensor", "0": tensor(4, 8)},
                             "input_grad": {"config": "tuple[1]", "0": "None"},   # x is not differentiated
                             "output_grad": {"config": "tuple[1]", "0": tensor(4, 8)}}
    assert struct["fc2"]["input_grad"] == {"config": "tuple[1]", "0": tensor(4, 8)}
    assert struct[""]["output"] == {"config": "tensor", "0": tensor(4, 3)}
    assert not glob.glob(str(output_root / "*-rank0-*" / "*.csv"))   # nothing else collected


def _line_of(function, text):
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_stack_info_names_the_call_site_of_each_cell_once(tmp_path, output_root):
    run(tmp_path, {"stack_info": True, "xy_distribution": True, "ops": ["norm"]}, steps=2)
    folder = glob.glob(str(output_root / "*-rank0-*"))[0]
    with open(os.path.join(folder, "stack_info.csv"), newline="") as file:
        table = list(csv.reader(file))
    assert table[0] == ["module_name", "stack_info"]
    stacks = {name: stack.split("\n") for name, stack in table[1:]}
    assert sorted(stacks) == ["", "act", "fc1", "fc2"]     # one row per cell, first step only
    source = activations_reference.__file__
    construct = _line_of(activations_reference.make_relu_model, "return self.fc2(self.act(self.fc1(x)))")
    loss = _line_of(activations_reference.train, "loss_fn(model(x), y)")
    for name in ("fc1", "act", "fc2"):
        assert stacks[name][0].startswith(f"{source}:{construct} in construct: return self.fc2("), stacks[name]
    assert stacks[""][0].startswith(f"{source}:{loss} in <lambda>:"), stacks[""]
    assert sorted(os.listdir(folder)) == ["actv_0-0.csv", "actv_1-1.csv", "actv_grad_0-0.csv", "actv_grad_1-1.csv",
                                          "stack_info.csv"]   # activations go on in step 1


def test_micro_batch_gradients_beside_activations(tmp_path, output_root):
    """monitor_mbs_grad and activations in one run: both per micro-step, both against numpy."""
    from tests.support.msprobe_reference import K, reference_run, statistic
    from mindmon.formats.msprobe_csv import read_csv
    from tests.support.activations_reference import activation_rows

    run(tmp_path, {"xy_distribution": True, "wg_distribution": True, "monitor_mbs_grad": True, "ops": ["norm"],
                   "ndigits": 12}, steps=2)
    reference = {**reference_run(steps=2), **activation_rows(2)}
    folder = glob.glob(str(output_root / "*-rank0-*"))[0]
    seen = set()
    for path in glob.glob(os.path.join(folder, "*.csv")):
        for record in read_csv(path):
            key = (record.kind, record.step - 1, record.micro_step, record.name)
            seen.add(key[:3])
            want = statistic(reference[key], "norm")
            assert abs(record.stat("norm") - want) <= 1e-5 * want + 1e-12, (key, record.stat("norm"), want)
    assert {(kind, s, k) for kind in ("actv", "actv_grad", "grad_unreduced") for s in range(2)
            for k in range(K)} <= seen


def test_print_struct_ends_a_plain_script_with_status_0_and_no_traceback(tmp_path):
    """The user's script does not catch StopTraining: the process ends cleanly, the message in the log."""
    import subprocess
    import sys

    (tmp_path / "monitor_config.json").write_text(json.dumps({"print_struct": True}))
    script = tmp_path / "train.py"
    script.write_text(
        "import logging, sys\n"
        f"sys.path.append({REPO!r})\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "import mindspore as ms\n"
        "ms.set_context(mode=ms.PYNATIVE_MODE)\n"
        "from tests.support.activations_reference import run_config\n"
        "import pathlib\n"
        "run_config(pathlib.Path(sys.argv[1]), {'print_struct': True}, steps=3)\n"
        "print('training went on')\n")
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(tmp_path / "out"), PYTHONPATH=os.getcwd())
    env.pop("DYNAMIC_MONITOR", None)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "training went on" not in done.stdout and "Traceback" not in done.stderr
    assert f"{tmp_path / 'out' / 'module_struct' / 'rank0' / 'module_struct.json'}" in done.stderr
