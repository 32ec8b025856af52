"""L2 features from a MindFormers YAML (`monitor.tensor_stats` with msprobe's L2 keys) through the stock
Trainer: the attention_hook and linear_hook rows in the msprobe CSV files, the JSONL and TensorBoard, against
float64 numpy on the Q and K the attention cell really got and the weights the step used (captured by the
test's own hooks)."""
import glob
import os

import numpy as np
import pytest

from tests.support.demo_trainer import SMALL_MODEL, make_data, make_model, trainer_config
from tests.support.jsonl import read_jsonl
from mindmon.formats.msprobe_csv import read_csv
from tests.features.l2.test_l2_features import reference_features

ATTENTION = "decoder.layers.0.self_attention.core_attention"
LINEAR = ("decoder.layers.0.self_attention.linear_qkv", "output_layer")
HEADS = SMALL_MODEL["num_attention_heads"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from mindformers.pynative.trainer import Trainer

    out = tmp_path_factory.mktemp("l2_yaml")
    config = trainer_config(out, steps=2, monitor={
        "tensor_stats": {"l2_targets": {"attention_hook": [ATTENTION], "linear_hook": list(LINEAR)},
                         "recording_l2_features": True, "ndigits": 12},
        "tensorboard": {"tensorboard_dir": str(out / "tb")}})
    model = make_model()
    trainer = Trainer(config=config, model=model, train_dataset=make_data(config))
    cells = dict(model.cells_and_names())
    seen = {"qk": [], "weights": []}

    def capture_qk(cell, inputs):
        if cell.training:
            seen["qk"].append((inputs[0].asnumpy().astype(np.float64), inputs[1].asnumpy().astype(np.float64)))

    def capture_weights(cell, inputs):
        seen["weights"].append({n: cells[n].weight.asnumpy().astype(np.float64) for n in LINEAR})

    cells[ATTENTION].register_forward_pre_hook(capture_qk)
    trainer.optimizer.register_forward_pre_hook(capture_weights)
    trainer.train()
    return out, seen, trainer.num_accumulation_steps


def expected_attention(q, k):
    """The cell's 2-D (tokens, heads x head_dim) Q and K as one sequence of tokens, causal."""
    tokens, hidden = q.shape
    shape = (1, tokens, HEADS, hidden // HEADS)
    return reference_features(q.reshape(shape), k.reshape(shape), causal=True)


def expected_linear(w):
    singular = np.linalg.svd(w, compute_uv=False)
    return [np.linalg.norm(w) / singular[0], np.linalg.norm(w)]


def test_csv_rows_against_numpy(run):
    out, seen, k = run
    (folder,) = glob.glob(str(out / "tensor_stats" / "*-rank0-*"))
    rows = [r for path in glob.glob(os.path.join(folder, "*_hook_*.csv")) for r in read_csv(path)]
    attention = sorted((r for r in rows if r.kind == "attention_hook"), key=lambda r: (r.step, r.micro_step))
    assert [(r.name, r.step, r.micro_step) for r in attention] == \
        [(f"{ATTENTION}.attention", s, m) for s in (1, 2) for m in range(k)]
    assert len(seen["qk"]) == 2 * k
    for record, (q, key) in zip(attention, seen["qk"]):
        assert record.value == pytest.approx(expected_attention(q, key), rel=1e-5), record
    linear = [r for r in rows if r.kind == "linear_hook"]
    assert {(r.name, r.step) for r in linear} == {(f"{n}.linear", s) for n in LINEAR for s in (1, 2)}
    for record in linear:
        w = seen["weights"][record.step - 1][record.name[:-len(".linear")]]
        assert record.value == pytest.approx(expected_linear(w), rel=1e-4), record


def test_jsonl_and_tensorboard_carry_the_features(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, seen, k = run
    rows = [r for r in read_jsonl(out / "rank_0" / "metrics.jsonl") if r["kind"] == "linear_hook"]
    row = next(r for r in rows if r["step"] == 2 and r["name"] == f"{LINEAR[1]}.linear")
    assert row["ops"] == ["sr", "kernel_norm"]
    np.testing.assert_allclose(row["value"], expected_linear(seen["weights"][1][LINEAR[1]]), rtol=1e-4)
    events = EventAccumulator(str(out / "tb" / "rank_0"), size_guidance={"scalars": 0})
    events.Reload()
    entropy = [e.value for e in events.Scalars(f"attention_hook/{ATTENTION}.attention/entropy")]
    assert len(entropy) >= 2   # one per step at least (micro-step rows share the step)
    assert entropy[-1] == pytest.approx(expected_attention(*seen["qk"][-1])[0], rel=1e-5)
