"""`monitor.tensorboard_tags`: what TensorBoard shows by default (gradient norms per layer, no per-parameter
cross-rank columns, no `_vs_samples` copies) and on request (every parameter, every copy), on a real plain
loop over the multi-layer test model; every value checked against numpy over the run's own JSONL."""
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.support.demo_trainer import SMALL_MODEL, make_model
from tests.support.jsonl import read_jsonl
from tests.sinks.test_tensorboard import GLOBAL_BATCH, K, assert_same, expected_scalars, scalars

STEPS, LOCAL_BATCH = 3, GLOBAL_BATCH // K
NORM_KINDS = ("local_norm", "micro_norm", "device_norm")
LAYER = re.compile(r"(.*?\.\d+)(?:\.|$)")   # docs/outputs.md: up to the first numeric component
STATISTICS = ("min", "mean", "max", "min_rank", "max_rank")


def layer(name):
    match = LAYER.match(name)
    return match.group(1) if match else name


def train(out, tags=None):
    """3 steps of K=4 micro-batches on the test model, every train_state switch, across_ranks and speed on;
    returns (rank 0's JSONL rows, its TensorBoard scalars)."""
    import mindspore as ms
    from mindspore import Tensor, nn

    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
    from mindmon.demo.data import make_sequences

    ms.set_seed(0)
    model = make_model()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.05)
    monitor = {"output_dir": str(out / "monitor"), "tensorboard": {"tensorboard_dir": str(out / "tb")},
               "train_state": {"local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True},
               "across_ranks": {"enabled": True}, "speed": {"enabled": True}}
    if tags is not None:
        monitor["tensorboard_tags"] = tags
    group = build_group(parse_sections({"monitor": monitor}), model=model,
                        parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(lambda ids, labels: model(ids, labels)[0], optimizer, K, group=group)
    group.setup(max_steps=STEPS, global_batch_size=GLOBAL_BATCH)
    sequences = make_sequences(STEPS * GLOBAL_BATCH, SMALL_MODEL["seq_length"], SMALL_MODEL["vocab_size"], seed=5)
    try:
        for step in range(1, STEPS + 1):
            batch = sequences[(step - 1) * GLOBAL_BATCH:step * GLOBAL_BATCH]
            loss, grad_norm = train_step(split_batch((Tensor(batch[:, :-1]), Tensor(batch[:, 1:])), K))
            group.flush(step, loss=loss, grad_norm=grad_norm, learning_rate=0.05)
    finally:
        group.close()
    return read_jsonl(out / "monitor" / "rank_0" / "metrics.jsonl"), scalars(out / "tb" / "rank_0")


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("tb_defaults"))


@pytest.fixture(scope="module")
def every_tag_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("tb_every_tag"), {"detail": "parameter", "vs_samples": True})


def per_parameter_column(row):
    return row["kind"] == "across_ranks" and row["name"].split("/")[0] in ("micro_norm", "accumulated_norm")


def layer_scalars(rows):
    """{`<kind>/<layer>`: {x: value}} from the per-parameter norms, in numpy: device_norm and micro_norm
    the norm of the layer's norms; local_norm the increments of the norm of the layer's accumulated
    gradients, each parameter's accumulated norm being the cumulative sum of its increments."""
    table = {}   # (kind, step, layer) -> {micro_step: {name: value}}
    for r in rows:
        if r["kind"] in NORM_KINDS:
            table.setdefault((r["kind"], r["step"], layer(r["name"])), {}).setdefault(r["micro_step"], {})[
                r["name"]] = r["value"]
    out = {}
    for (kind, step, name), by_micro in table.items():
        tag = out.setdefault(f"{kind}/{name}", {})
        if kind == "device_norm":
            tag[step] = np.float32(np.linalg.norm(list(by_micro[None].values())))
            continue
        parameters = sorted(by_micro[0])
        values = np.array([[by_micro[k][p] for p in parameters] for k in range(K)])
        if kind == "local_norm":
            values = np.diff(np.linalg.norm(np.cumsum(values, axis=0), axis=1), prepend=0.0)
        else:
            values = np.linalg.norm(values, axis=1)
        for k in range(K):
            tag[(step - 1) * K + k] = np.float32(values[k])
    return out


def test_defaults_give_layer_norms_and_no_copies(default_run):
    rows, actual = default_run
    assert {"local_norm", "micro_norm", "device_norm", "across_ranks", "step_time", "samples"} <= {
        r["kind"] for r in rows}
    plain = [r for r in rows if r["kind"] not in NORM_KINDS and not per_parameter_column(r)]
    expected = {t: v for t, v in expected_scalars(plain).items() if not t.endswith("_vs_samples")}
    expected.update(layer_scalars(rows))
    assert_same(actual, expected)
    layers = {"embedding.word_embeddings.weight", "decoder.layers.0", "decoder.layers.1",
              "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight",
              "mtp.layers.0"}
    for kind in NORM_KINDS:
        assert {t.split("/", 1)[1] for t in actual if t.startswith(kind + "/")} == layers
    assert not [t for t in actual if t.endswith("_vs_samples")]
    assert {t.split("/")[1] for t in actual if t.startswith("across_ranks/")} == {"local_loss", "device_loss"}


def test_a_layers_increments_add_up_to_its_device_norm(default_run):
    """One rank: a layer's local_norm increments over a step sum to its accumulated norm, which is the
    layer's device_norm (the norm of the same gradient, from the other record kind)."""
    _, actual = default_run
    for step in range(1, STEPS + 1):
        for name in ("decoder.layers.0", "decoder.layers.1", "mtp.layers.0", "output_layer.weight"):
            increments = [actual[f"local_norm/{name}"][(step - 1) * K + k] for k in range(K)]
            assert sum(increments) == pytest.approx(actual[f"device_norm/{name}"][step], rel=2e-5), (step, name)


def test_tag_count_at_defaults_and_with_every_tag(default_run, every_tag_run):
    """Counted by hand: the model's 49 parameters fall in 7 groups (test above), 3 norm kinds each; the other
    tags are the step values, speed, and the loss spread across ranks (53 in all here, against 1,338)."""
    rows, actual = default_run
    parameters = len({r["name"] for r in rows if r["kind"] == "device_norm"})
    others = {t for t in actual if t.split("/")[0] not in NORM_KINDS}
    assert parameters == 49
    assert len(actual) == 3 * 7 + len(others)
    assert len([t for t in others if t.startswith("across_ranks/")]) == 2 * 5   # local_loss, device_loss
    _, every = every_tag_run
    # per parameter: 3 norm kinds + 5 accumulated_norm statistics + 5 micro_norm statistics; every tag twice
    assert len(every) == 2 * (len(others) + 49 * (3 + 5 + 5))


def test_parameter_detail_and_vs_samples_give_every_tag(every_tag_run):
    rows, actual = every_tag_run
    assert_same(actual, expected_scalars(rows))
    assert "device_norm/decoder.layers.0.self_attention.linear_qkv.weight_vs_samples" in actual
    assert "across_ranks/accumulated_norm/output_layer.weight/max_rank" in actual


def test_layer_of_a_parameter_name():
    from mindmon.sinks.tensorboard import layer_of

    assert layer_of("decoder.layers.3.self_attention.linear_qkv.weight") == "decoder.layers.3"
    assert layer_of("model.layers.31.mlp.experts.7.w1") == "model.layers.31"   # the first number only
    assert layer_of("net.0.weight") == "net.0"
    assert layer_of("layer0.weight") == "layer0.weight"   # a number inside a word is no layer index
    assert layer_of("decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"


def test_cross_rank_spread_of_step_values_stays(tmp_path):
    """Rank 0's across_ranks records of two ranks, as written: the step values' spread (loss, step time,
    throughput, tokens per expert) keeps its tags; per-parameter columns go."""
    from mindmon.core.engine import RunInfo
    from mindmon.core.records import Record
    from mindmon.sinks.tensorboard import TensorBoardSink

    kept = ["local_loss/max_rank", "device_loss/min", "step_time/step/max", "throughput/samples_per_second/min_rank",
            "tokens_per_expert_step/decoder.layers.1/expert_0/mean"]
    dropped = ["micro_norm/decoder.layers.0.mlp.linear_fc1.weight/max", "accumulated_norm/output_layer.weight/mean"]
    sink = TensorBoardSink(str(tmp_path), detail="layer", vs_samples=False)
    sink.open(RunInfo(rank=0, global_batch_size=8))
    sink.write([Record(1, None, 0, "across_ranks", name, float(i)) for i, name in enumerate(kept + dropped)])
    sink.close()
    assert scalars(tmp_path / "rank_0") == {f"across_ranks/{name}": {1: float(i)} for i, name in enumerate(kept)}


def test_monitor_config_keeps_mindformers_per_parameter_tags(tmp_path):
    """MindFormers' TrainingStateMonitor names a parameter in its `local_norm/<parameter>` tag: under
    monitor_config the sink leaves the norms per parameter, whatever the detail."""
    from mindmon import build_group, parse_sections
    from mindmon.core.records import Record

    config = parse_sections({"monitor": {"output_dir": str(tmp_path / "monitor")},
                             "monitor_config": {"monitor_on": True, "local_norm_format": ["tensorboard"]},
                             "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}})
    names = ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"]
    group = build_group(config, parameter_names=names)
    group.setup(max_steps=1)
    group.write([Record(1, 0, 0, "local_norm", name, 0.5 + i) for i, name in enumerate(names)])
    group.close()
    assert scalars(tmp_path / "tb" / "rank_0") == {f"local_norm/{name}": {0: 0.5 + i} for i, name in enumerate(names)}


@pytest.mark.parametrize("section,message", [
    ({"detail": "layers"},
     "monitor.tensorboard_tags.detail: got 'layers' (str); allowed: one of ['layer', 'parameter']"),
    ({"detail": None}, "monitor.tensorboard_tags.detail: got None (NoneType); allowed: one of ['layer', 'parameter']"),
    ({"vs_samples": "yes"}, "monitor.tensorboard_tags.vs_samples: got 'yes' (str); allowed: True or False"),
    ({"vs_sample": True}, "monitor.tensorboard_tags.vs_sample: unknown key 'vs_sample' (did you mean "
                          "'vs_samples'?); allowed keys: ['detail', 'vs_samples']"),
    ("per layer", "monitor.tensorboard_tags: got 'per layer' (str); allowed: a mapping with keys "
                  "['detail', 'vs_samples']"),
])
def test_a_bad_section_is_one_line_naming_the_key(tmp_path, section, message):
    import yaml

    from mindmon import parse_sections
    from mindmon.config import ConfigError

    with pytest.raises(ConfigError) as error:
        parse_sections({"monitor": {"tensorboard_tags": section}})
    assert str(error.value) == message
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"monitor": {"tensorboard_tags": section}}))
    result = subprocess.run([sys.executable, "-m", "mindmon", "check-config", str(path)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr


def seven_b_step(k_steps=2):
    """One step of a 7B-sized dense model's train_state and rank 0's cross-rank records, as MindFormers'
    Llama names its 291 tensors (32 layers of 9, the embedding, the final norm, the output layer)."""
    from mindmon.core.records import Record

    per_layer = ["attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                 "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
                 "attention_norm.weight", "ffn_norm.weight"]
    names = [f"model.layers.{i}.{p}" for i in range(32) for p in per_layer]
    names += ["model.tok_embeddings.embedding_weight", "model.norm_out.weight", "lm_head.weight"]
    records = [Record(1, None, 0, "device_norm", n, 1.0) for n in names]
    for k in range(k_steps):
        records += [Record(1, k, 0, kind, n, 0.5) for kind in ("local_norm", "micro_norm") for n in names]
        records += [Record(1, k, 0, "across_ranks", f"local_loss/{s}", 2.0) for s in STATISTICS]
        records += [Record(1, k, 0, "across_ranks", f"micro_norm/{n}/{s}", 0.5) for n in names for s in STATISTICS]
    records += [Record(1, None, 0, "across_ranks", f"device_loss/{s}", 2.0) for s in STATISTICS]
    records += [Record(1, None, 0, "across_ranks", f"accumulated_norm/{n}/{s}", 1.0) for n in names
                for s in STATISTICS]
    return names, records


@pytest.mark.parametrize("detail,count", [("layer", 3 * 35 + 2 * 5), ("parameter", 291 * 3 + 291 * 10 + 2 * 5)])
def test_a_7b_sized_models_norm_tags(tmp_path, detail, count):
    """docs/outputs.md's count for 291 tensors: 35 groups (32 layers and 3 tensors of their own), 3 norm
    kinds each, and the loss spread; every parameter's curve and cross-rank columns with `detail: parameter`."""
    from mindmon.core.engine import RunInfo
    from mindmon.sinks.tensorboard import TensorBoardSink

    names, records = seven_b_step()
    assert len(names) == 291
    sink = TensorBoardSink(str(tmp_path), detail=detail, vs_samples=False)
    sink.open(RunInfo(rank=0, global_batch_size=8, micro_steps_per_step=2))
    sink.write(records)
    sink.close()
    tags = scalars(tmp_path / "rank_0")
    assert len(tags) == count
    if detail == "layer":   # 9 tensors of norm 1: the layer's norm is 3; of increments 0.5 each: 1.5 then 1.5
        assert tags["device_norm/model.layers.31"] == {1: 3.0}
        assert tags["local_norm/model.layers.0"] == {0: 1.5, 1: 1.5}
        assert tags["micro_norm/lm_head.weight"] == {0: 0.5, 1: 0.5}
