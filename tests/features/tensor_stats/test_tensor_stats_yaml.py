"""`monitor.tensor_stats` in a MindFormers YAML: msprobe's statistics from the stock Trainer with the
launch script unchanged, in the msprobe CSV files, the JSONL and TensorBoard, against numpy on the
tensors the optimizer really got (captured by the test's own hooks on the same optimizer)."""
import csv
import glob
import os

import numpy as np
import pytest

from tests.support.demo_trainer import make_data, make_model, trainer_config
from tests.support.jsonl import read_jsonl

OPS = ["min", "max", "mean", "norm", "zeros", "nans"]
EPS = 1e-3


def _stats(array):
    flat = np.asarray(array, np.float64).ravel()
    return [flat.min(), flat.max(), flat.mean(), np.sqrt((flat * flat).sum()),
            float((np.abs(flat) < EPS).mean()), float(np.isnan(flat).sum())]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from mindformers.pynative.trainer import Trainer

    out = tmp_path_factory.mktemp("tensor_stats")
    config = trainer_config(out, steps=2, monitor={
        "tensor_stats": {"param_distribution": True, "wg_distribution": True, "ops": OPS, "eps": EPS,
                         "ndigits": 12},
        "tensorboard": {"tensorboard_dir": str(out / "tb")}})
    model = make_model()
    trainer = Trainer(config=config, model=model, train_dataset=make_data(config))
    names = [p.name for p in trainer.optimizer.parameters]
    seen = {"origin": [], "grads": [], "updated": []}

    def before(cell, inputs):
        seen["grads"].append([g.asnumpy().copy() for g in inputs[0]])
        seen["origin"].append([p.asnumpy().copy() for p in trainer.optimizer.parameters])

    def after(cell, inputs, output):
        seen["updated"].append([p.asnumpy().copy() for p in trainer.optimizer.parameters])

    trainer.optimizer.register_forward_pre_hook(before)
    trainer.optimizer.register_forward_hook(after)
    trainer.train()
    return out, names, seen


def test_csv_rows_equal_numpy(run):
    out, names, seen = run
    folders = glob.glob(str(out / "tensor_stats" / "*-rank0-*"))
    assert len(folders) == 1
    for prefix, key in (("param_origin", "origin"), ("param_updated", "updated"), ("grad_reduced", "grads")):
        for step in (0, 1):
            with open(os.path.join(folders[0], f"{prefix}_{step}-{step}.csv"), newline="") as handle:
                lines = list(csv.reader(handle))
            assert lines[0] == ["vpp_stage", "name", "step", *OPS, "shape", "dtype"]
            assert all(len(line) == len(lines[0]) and line[2] == str(step) for line in lines[1:])
            by_name = {line[1]: dict(zip(lines[0], line)) for line in lines[1:]}
            assert set(by_name) == set(names)
            for name, tensor in zip(names, seen[key][step]):
                got = [float(by_name[name][op]) for op in OPS]
                np.testing.assert_allclose(got, _stats(tensor), rtol=1e-5, atol=1e-9, err_msg=f"{prefix} {name}")


def test_jsonl_and_tensorboard_carry_the_same_statistics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, names, seen = run
    rows = [r for r in read_jsonl(out / "rank_0" / "metrics.jsonl") if r["kind"] == "grad_reduced"]
    assert {(r["step"], r["name"]) for r in rows} == {(s, n) for s in (1, 2) for n in names}
    row = next(r for r in rows if r["step"] == 2 and r["name"] == names[0])
    assert row["ops"] == OPS and row["shape"] == list(seen["grads"][1][0].shape)
    np.testing.assert_allclose(row["value"], _stats(seen["grads"][1][0]), rtol=1e-5, atol=1e-9)
    events = EventAccumulator(str(out / "tb" / "rank_0"), size_guidance={"scalars": 0})
    events.Reload()
    norm = {e.step: e.value for e in events.Scalars(f"grad_reduced/{names[0]}/norm")}
    np.testing.assert_allclose([norm[1], norm[2]], [_stats(g[0])[3] for g in seen["grads"]], rtol=1e-5)
