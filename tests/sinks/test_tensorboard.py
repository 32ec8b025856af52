"""The TensorBoard sink and `mindmon to-tensorboard`: event files read back with TensorBoard's own
EventAccumulator, every value checked against the JSONL of the same run (the demo trained with the
shipped configs/tensorboard.yaml, conftest's `view_demo`)."""
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.demo_trainer import VIEW_DEMO_STEPS, train, trainer_config
from tests.support.jsonl import read_jsonl

K, GLOBAL_BATCH = 4, 8   # configs/demo.yaml: global_batch_size 8, local_batch_size 2


def scalars(log_dir):
    """{tag: {step: value}} of every scalar in the event files of log_dir."""
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    out = {}
    for tag in accumulator.Tags()["scalars"]:
        events = accumulator.Scalars(tag)
        out[tag] = {e.step: e.value for e in events}
        assert len(out[tag]) == len(events), f"{tag}: two values at one step"
    return out


def expected_scalars(rows):
    """What the sink should write for JSONL rows, derived here from the README's tag table."""
    megatron = {"loss": "lm_loss", "grad_norm": "grad-norm", "learning_rate": "learning-rate"}
    points = []   # (tag, step axis, samples axis, value)
    all_heads = {}
    for r in rows:
        step, micro, kind, name, value = r["step"], r["micro_step"], r["kind"], r["name"], r["value"]
        if micro is None:
            x, samples = step, step * GLOBAL_BATCH
        else:
            x, samples = (step - 1) * K + micro, (step - 1) * GLOBAL_BATCH + (micro + 1) * GLOBAL_BATCH // K
        if kind in ("samples", "max_attention_logit_mean", "max_attention_logit_max"):
            continue   # an axis; the summaries are derived from the heads below
        if kind == "max_attention_logit":
            points.append((f"max_attention_logit/{name}", x, samples, max(value)))
            points += [(f"max_attention_logit/{name}/head_{h}", x, samples, v) for h, v in enumerate(value)]
            all_heads.setdefault(step, []).extend(value)
        elif kind == "tokens_per_expert":
            assert r["iter"] == x
            points += [(f"tokens_per_expert/{name}/expert_{e}", x, samples, v) for e, v in enumerate(value)]
        elif kind == "tokens_per_expert_step":
            points += [(f"tokens_per_expert_step/{name}/expert_{e}", x, samples, v) for e, v in enumerate(value)]
        elif kind in megatron:
            points.append((megatron[kind], x, samples, value))
        elif kind in ("local_loss", "device_loss"):
            points.append((kind, x, samples, value))
        else:
            points.append((f"{kind}/{name}", x, samples, value))
    for step, heads in all_heads.items():
        points.append(("max_attention_logit", step, step * GLOBAL_BATCH, max(heads)))
        points.append(("max_attention_logit/mean", step, step * GLOBAL_BATCH, float(np.mean(heads))))
    expected = {}
    for tag, x, samples, value in points:
        expected.setdefault(tag, {})[x] = np.float32(value)            # TensorBoard scalars are float32
        expected.setdefault(tag + "_vs_samples", {})[samples] = np.float32(value)
    return expected


def assert_same(actual, expected):
    assert set(actual) == set(expected), (sorted(set(actual) ^ set(expected)))[:10]
    for tag, points in expected.items():
        assert set(actual[tag]) == set(points), tag
        for x, value in points.items():
            assert np.float32(actual[tag][x]) == pytest.approx(value, rel=1e-6, abs=1e-7), (tag, x)


def test_sink_events_equal_the_jsonl(view_demo):
    rows = read_jsonl(view_demo / "monitor" / "rank_0" / "metrics.jsonl")
    kinds = {r["kind"] for r in rows}
    assert {"local_norm", "device_norm", "local_loss", "device_loss", "micro_norm", "max_attention_logit",
            "tokens_per_expert", "moe_cv", "loss", "grad_norm", "learning_rate", "samples"} <= kinds
    actual = scalars(view_demo / "tensorboard" / "rank_0")
    assert_same(actual, expected_scalars(rows))
    # The Megatron tags are there, one point per step, and the lr follows the demo's 2-step warm-up.
    assert sorted(actual["grad-norm"]) == list(range(1, VIEW_DEMO_STEPS + 1))
    assert actual["learning-rate"][1] == pytest.approx(1.5e-3) and actual["learning-rate"][3] == pytest.approx(3e-3)


def test_to_tensorboard_writes_what_the_sink_wrote(view_demo, tmp_path):
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "to-tensorboard", str(view_demo / "monitor"),
                             "-o", str(tmp_path / "tb")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "rank 0:" in result.stderr   # progress
    assert scalars(tmp_path / "tb" / "rank_0") == scalars(view_demo / "tensorboard" / "rank_0")


def test_tensorboard_alone_records_the_trainer_values(tmp_path):
    """Only `monitor.tensorboard`: no train_state switch, yet loss, grad norm and lr reach TensorBoard,
    equal to what MindFormers' own LossCallback prints."""
    config = trainer_config(tmp_path, steps=2, monitor={"tensorboard": {"tensorboard_dir": str(tmp_path / "tb")},
                                                        "tensorboard_tags": {"vs_samples": True}})
    trainer = train(config)
    actual = scalars(tmp_path / "tb" / "rank_0")
    assert set(actual) == {"lm_loss", "grad-norm", "learning-rate", "max_norm/global", "lm_loss_vs_samples",
                           "grad-norm_vs_samples", "learning-rate_vs_samples", "max_norm/global_vs_samples"}
    assert actual["learning-rate"] == {1: pytest.approx(1e-2), 2: pytest.approx(1e-2)}   # constant lr, no warm-up
    assert actual["max_norm/global"] == {1: 1.0, 2: 1.0}   # training.max_norm: the clipping threshold
    assert sorted(actual["lm_loss_vs_samples"]) == [8, 16]
    assert trainer.state.global_step == 2


def test_log_interval_and_queue(tmp_path):
    from mindmon.core.records import Record
    from mindmon.sinks.tensorboard import TensorBoardSink

    from mindmon.core.engine import RunInfo

    sink = TensorBoardSink(str(tmp_path), log_interval=2, queue_size=5)
    sink.open(RunInfo(rank=3))
    for step in range(1, 6):
        sink.write([Record(step, None, 3, "grad_norm", "global", 0.5 * step)])
    sink.close()
    assert scalars(tmp_path / "rank_3") == {"grad-norm": {2: 1.0, 4: 2.0}}   # no batch size: no vs-samples tag


def test_two_sinks_in_one_folder_keep_their_own_files(tmp_path):
    """Two writers opened in one folder within the same second (two TrainerMons of one process, or ranks
    given one folder): each has its own file, `events.out.tfevents.<time>.<host>.<pid>.<n>`; neither is cut."""
    import os
    import re
    import socket

    from mindmon.core.engine import RunInfo
    from mindmon.core.records import Record
    from mindmon.sinks.tensorboard import TensorBoardSink

    sinks = [TensorBoardSink(str(tmp_path), per_rank=False) for _ in range(2)]
    for rank, sink in enumerate(sinks):
        sink.open(RunInfo(rank=rank))
    for rank, sink in enumerate(sinks):
        sink.write([Record(1, None, rank, "max_norm", f"rank{rank}", 1.5 + rank)])
        sink.close()
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2
    pattern = rf"events\.out\.tfevents\.\d+\.{re.escape(socket.gethostname())}\.{os.getpid()}\.\d+"
    assert all(re.fullmatch(pattern, n) for n in names), names
    assert scalars(tmp_path) == {"max_norm/rank0": {1: 1.5}, "max_norm/rank1": {1: 2.5}}   # both files whole


@pytest.mark.parametrize("section,key,message", [
    ({"tensorboard_dir": 3}, "monitor.tensorboard.tensorboard_dir", "directory path"),
    ({"tensorboard_dir": "x", "tensorboard_log_interval": 0}, "monitor.tensorboard.tensorboard_log_interval",
     "positive int"),
    ({"tensorboard_dir": "x", "tensorboard_queue_size": "big"}, "monitor.tensorboard.tensorboard_queue_size",
     "positive int"),
    ({"tensorboard_dir": "x", "log_dir": "y"}, "monitor.tensorboard", "tensorboard_log_interval"),
])
def test_bad_tensorboard_section(section, key, message):
    from mindmon.config import ConfigError
    from mindmon.features import parse_sections

    with pytest.raises(ConfigError) as info:
        parse_sections({"monitor": {"tensorboard": section}})
    assert key in str(info.value) and message in str(info.value)


def test_tensorboard_section_parsed_and_passed_to_mindformers():
    from mindmon.features import parse_sections
    from mindmon.integrations.mindformers import stock_sections

    section = {"tensorboard_dir": "./tb", "tensorboard_log_interval": 5}
    raw = {"monitor": {"tensorboard": section, "train_state": {"local_loss": True}}}
    parsed = parse_sections(raw).monitor.tensorboard
    assert (parsed.enabled, parsed.tensorboard_dir, parsed.tensorboard_log_interval, parsed.tensorboard_queue_size) \
        == (True, "./tb", 5, 1000)
    assert not parse_sections({}).monitor.tensorboard.enabled
    assert stock_sections(raw)["monitor"] == {"tensorboard": section}   # MindFormers 1.9.0 still gets its key
