"""Activations from a MindFormers YAML (`monitor.tensor_stats.xy_distribution`) through the stock Trainer:
the CSV rows of one cell against numpy on the tensors the cell really got and gave (the test's own hooks
on the same cell), per micro-step."""
import glob
import os

import numpy as np

from tests.support.demo_trainer import make_data, make_model, trainer_config
from mindmon.formats.msprobe_csv import read_csv

CELL = "decoder.layers.0.mlp.linear_fc2"


def test_yaml_activations_equal_numpy(tmp_path):
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, steps=2, monitor={"tensor_stats": {
        "xy_distribution": True, "forward_only": True, "ops": ["norm", "max"], "ndigits": 12,
        "targets": {CELL: {"output": "tensor"}}}})
    model = make_model()
    trainer = Trainer(config=config, model=model, train_dataset=make_data(config))
    outputs = []
    cell = dict(model.cells_and_names())[CELL]
    cell.register_forward_hook(lambda c, inputs, output: outputs.append(output.asnumpy().astype(np.float64)))
    trainer.train()
    (folder,) = glob.glob(str(tmp_path / "tensor_stats" / "*-rank0-*"))
    rows = [r for step in (0, 1) for r in read_csv(os.path.join(folder, f"actv_{step}-{step}.csv"))]
    assert [r.name for r in rows] == [f"{CELL}.output"] * len(outputs)
    k = len(outputs) // 2
    assert [(r.step - 1, r.micro_step) for r in rows] == [(s, m) for s in (0, 1) for m in range(k)]
    for record, output in zip(rows, outputs):
        assert abs(record.stat("norm") - np.sqrt((output ** 2).sum())) <= 1e-5 * record.stat("norm")
        assert abs(record.stat("max") - output.max()) <= 1e-6 * abs(output.max()) + 1e-12
