"""Two real msrun worker processes (`mindmon demo --workers 2`), data parallel over `mccl` on CPU.

The reference replays step 1 in this process: the same model init, each rank's shard of the data
(MindSpore's own sharding), plain `value_and_grad` per micro-batch, numpy for the cross-rank mean.
"""
import csv
import os
import subprocess
import sys

import mindspore.dataset as ds
import numpy as np
import pytest
import yaml
from mindspore import Tensor, value_and_grad

from tests.support.demo_trainer import SMALL_MODEL
from tests.support.jsonl import read_jsonl
from mindmon.demo.data import make_sequences
from mindmon.demo.model import DemoModelConfig, DemoMoEGPT

RANKS, GBS, LBS, STEPS, SEED = 2, 8, 2, 2, 42
K = GBS // (RANKS * LBS)  # 2 micro-steps per step on each rank


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp2")
    overlay = {
        "model": SMALL_MODEL,
        "training": {"global_batch_size": GBS, "local_batch_size": LBS, "seed": SEED},
        "monitor": {"metrics_formats": ["jsonl", "parquet"],
                    "train_state": {"local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True},
                    "moe_monitor": {"save_tokens_per_expert_interval": 1}},
        "profiler": {"enable_profiling": True, "start_step": 2, "end_step": 2, "profiler_rank": [1],
                     "output_path": str(out / "profile"), "with_stack": False},
        "callbacks": [{"type": "MaxLogitsMonitor", "step_interval": 1}],
    }
    (out / "dp2.yaml").write_text(yaml.safe_dump(overlay))
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "demo", "--workers", str(RANKS), "--steps", str(STEPS),
                             "--output", str(out), "--config", str(out / "dp2.yaml")],
                            capture_output=True, text=True, env=env, cwd=out, timeout=900)
    logs = "".join((out / "msrun" / f"worker_{r}.log").read_text()[-3000:] for r in range(RANKS))
    assert result.returncode == 0, result.stdout[-2000:] + logs
    records = {r: read_jsonl(out / "monitor" / f"rank_{r}" / "metrics.jsonl") for r in range(RANKS)}
    return out, records


def _values(records, kind, step=1):
    return {(r["micro_step"], r["name"]): r["value"] for r in records if r["kind"] == kind and r["step"] == step}


def _first_batch(rank):
    """Step 1's batch of one rank: the demo's data, sharded by MindSpore as the worker shards it."""
    sequences = make_sequences(STEPS * GBS, SMALL_MODEL["seq_length"], SMALL_MODEL["vocab_size"], SEED)
    shard = ds.NumpySlicesDataset((sequences[:, :-1], sequences[:, 1:]), column_names=["input_ids", "labels"],
                                  shuffle=False, num_shards=RANKS, shard_id=rank).batch(GBS // RANKS)
    return next(shard.create_dict_iterator(output_numpy=True))


def _replay_step1():
    """Per rank: micro-batch losses, the accumulated gradient (sum of grad(loss_k / K)) and the
    per-head max attention logit of its micro-batches, from a fresh model with the demo's init."""
    model = DemoMoEGPT(DemoModelConfig.from_dict(SMALL_MODEL))
    model.set_train(True)
    model.track_max_attention_logit = True
    params = model.trainable_params()
    grad_fn = value_and_grad(lambda ids, labels: model(ids, labels)[0], None, params)
    per_rank = {}
    for rank in range(RANKS):
        batch = _first_batch(rank)
        losses, accumulated = [], {p.name: 0.0 for p in params}
        for k in range(K):
            rows = slice(k * LBS, (k + 1) * LBS)
            loss, grads = grad_fn(Tensor(batch["input_ids"][rows]), Tensor(batch["labels"][rows]))
            losses.append(float(loss.asnumpy()))
            for p, g in zip(params, grads):
                accumulated[p.name] = accumulated[p.name] + g.asnumpy().astype(np.float64) / K
        logits = {name: v.asnumpy().copy() for name, v in model.get_max_attention_logit().items()}
        model.reset_max_attention_logit()
        per_rank[rank] = (losses, accumulated, logits)
    return per_rank


def test_losses_and_norms_against_a_replay(run):
    _, records = run
    replay = _replay_step1()
    for rank in range(RANKS):
        local = _values(records[rank], "local_loss")
        assert [local[(k, "loss")] for k in range(K)] == pytest.approx(replay[rank][0], rel=1e-5)
    assert _values(records[0], "local_loss") != _values(records[1], "local_loss")  # different data
    everything = [loss for rank in range(RANKS) for loss in replay[rank][0]]
    for rank in range(RANKS):  # the mean over both ranks' micro-batches, identical on both
        assert _values(records[rank], "device_loss")[(None, "loss")] == pytest.approx(np.mean(everything), rel=1e-5)
    mean_grad = {n: (replay[0][1][n] + replay[1][1][n]) / RANKS for n in replay[0][1]}
    for rank in range(RANKS):
        device = _values(records[rank], "device_norm")
        assert set(n for _, n in device) == set(mean_grad)
        for name, grad in mean_grad.items():
            assert device[(None, name)] == pytest.approx(np.linalg.norm(grad), rel=1e-4, abs=1e-7)
        micro = _values(records[rank], "micro_norm")  # this rank's own, before any reduction
        assert micro[(K - 1, "output_layer.weight")] != _values(records[1 - rank], "micro_norm")[(K - 1, "output_layer.weight")]


def test_max_logits_are_the_max_over_ranks(run):
    _, records = run
    replay = _replay_step1()
    for rank in range(RANKS):
        logged = _values(records[rank], "max_attention_logit")
        assert len(logged) == 3
        for (_, name), value in logged.items():
            expected = np.maximum(replay[0][2][name], replay[1][2][name])
            np.testing.assert_allclose(value, expected, rtol=1e-5)


def test_tokens_per_expert_local_with_a_cross_rank_total(run):
    _, records = run
    for step in (1, 2):
        totals = [_values(records[rank], "tokens_per_expert_step", step) for rank in range(RANKS)]
        assert totals[0] == totals[1]
        for (_, layer), total in totals[0].items():
            per_micro_step = [np.array(v) for rank in range(RANKS)
                              for (_, name), v in _values(records[rank], "tokens_per_expert", step).items() if name == layer]
            assert len(per_micro_step) == RANKS * K
            assert total == np.sum(per_micro_step, axis=0).tolist()


def _replay_router_step1():
    """{layer: tokens per expert of step 1 summed over both ranks and their micro-batches}, counted from
    the top-k of each router's scores in a forward pass of a fresh model over each rank's shard."""
    from types import SimpleNamespace

    from tests.support.demo_trainer import count_router_choices

    model = DemoMoEGPT(DemoModelConfig.from_dict(SMALL_MODEL))
    model.set_train(True)
    counts = count_router_choices(model, SimpleNamespace(step=1), SMALL_MODEL["moe_router_topk"])
    totals = {}
    for rank in range(RANKS):
        batch = _first_batch(rank)
        for k in range(K):
            rows = slice(k * LBS, (k + 1) * LBS)
            model(Tensor(batch["input_ids"][rows]), Tensor(batch["labels"][rows]))
        for (_, _, layer), tokens in counts.items():
            totals[layer] = totals.get(layer, 0) + tokens
        counts.clear()
    return totals


def _load_summaries(tokens):
    """The documented summaries of one layer's step total, in float64 numpy."""
    tokens = np.asarray(tokens, dtype=np.float64)
    summaries = {"moe_min_tokens": tokens.min(), "moe_max_tokens": tokens.max(),
                 "moe_idle_experts": float(np.sum(tokens == 0))}
    if tokens.mean() > 0:
        summaries.update(moe_max_over_mean=tokens.max() / tokens.mean(), moe_cv=tokens.std() / tokens.mean())
    return summaries


def test_moe_load_summaries_of_the_sum_over_ranks(run):
    """Step 1 against the router replay; every step: tokens_per_expert_step is the sum over both ranks of
    their per-micro-step records, and each summary is numpy's on that total, identical on both ranks."""
    _, records = run
    routed = _replay_router_step1()
    layers = {name for (_, name) in _values(records[0], "tokens_per_expert_step")}
    assert layers == set(routed) and len(layers) >= 2  # a decoder MoE layer and the MTP layer
    for step in (1, 2):
        for layer in layers:
            total = np.sum([v for rank in range(RANKS) for (_, name), v in
                            _values(records[rank], "tokens_per_expert", step).items() if name == layer], axis=0)
            if step == 1:
                np.testing.assert_array_equal(total, routed[layer])
            for rank in range(RANKS):
                assert _values(records[rank], "tokens_per_expert_step", step)[(None, layer)] == total.tolist()
                got = {kind: _values(records[rank], kind, step)[(None, layer)]
                       for kind in ("moe_min_tokens", "moe_max_tokens", "moe_idle_experts", "moe_max_over_mean",
                                    "moe_cv") if (None, layer) in _values(records[rank], kind, step)}
                assert got == pytest.approx(_load_summaries(total), rel=1e-12, abs=0)


def test_profiler_rank_selects_rank_1_only(run):
    out, _ = run
    assert sorted(os.listdir(out / "profile")) == ["rank_1"]
    assert any(name.endswith("_ascend_ms") for name in os.listdir(out / "profile" / "rank_1"))


def test_every_rank_writes_its_own_files(run):
    out, records = run
    for rank in range(RANKS):
        assert {r["rank"] for r in records[rank]} == {rank}
        assert (out / "monitor" / "tokens_per_expert" / f"rank{rank}.jsonl").exists()
        assert "device_loss" in (out / "log" / f"rank_{rank}" / "info.log").read_text()


def test_merge_table(run):
    out, records = run
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "merge", str(out)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    with open(out / "merged.csv", newline="") as handle:
        rows = {(r["kind"], r["name"], r["step"], r["micro_step"]): r for r in csv.DictReader(handle)}
    for (micro_step, _), _ in _values(records[0], "local_loss").items():
        row = rows[("local_loss", "loss", "1", str(micro_step))]
        per_rank = [_values(records[r], "local_loss")[(micro_step, "loss")] for r in range(RANKS)]
        assert float(row["min"]) == pytest.approx(min(per_rank)) and float(row["max"]) == pytest.approx(max(per_rank))
        assert float(row["mean"]) == pytest.approx(np.mean(per_rank))
        assert int(row["max_rank"]) == int(np.argmax(per_rank))
    device = rows[("device_loss", "loss", "2", "")]
    assert device["min"] == device["max"] and device["ranks"] == "2"


def test_the_parquet_files_equal_the_jsonl_and_merge_equals_the_python_merge(run, tmp_path):
    """Both formats on: each rank's Parquet holds its JSONL's records, with its data-parallel rank; merge
    from the Parquet files writes the CSV the pure-Python merge wrote from the JSONL, byte for byte."""
    import filecmp

    from tests.support import reference_tools
    from tests.formats.test_columnar import assert_same_records

    from mindmon.analysis.merge import merge
    from mindmon.formats import columnar, jsonl

    out, _ = run
    for rank in range(RANKS):
        folder = out / "monitor" / f"rank_{rank}"
        assert not (folder / "metrics.arrows").exists()   # compacted at train end
        assert_same_records(columnar.read_records(str(folder / "metrics.parquet")),
                            jsonl.read_records(str(folder / "metrics.jsonl")))
        assert set(columnar.read_table(str(folder / "metrics.parquet")).column("dp").to_pylist()) == {rank}
    want, want_flagged = reference_tools.merge(str(out / "monitor"), str(tmp_path / "python.csv"))
    got, flagged = merge(str(out / "monitor"), str(tmp_path / "engine.csv"), source="columnar", progress=None)
    assert filecmp.cmp(want, got, shallow=False) and repr(flagged) == repr(want_flagged)


def test_monitor_ranks_pick_who_collects():
    from mindmon.config import ConfigError
    from mindmon import parse_sections
    from mindmon.core.factory import build_callbacks, build_group

    config = parse_sections({"monitor": {"ranks": [0, 2], "train_state": {"device_loss": True}}})
    assert [build_group(config, rank=r).active for r in range(3)] == [True, False, True]
    assert build_callbacks(build_group(config, rank=1), config) == []
    for bad in ([], [-1], "0", [0.5]):
        with pytest.raises(ConfigError, match=r"monitor\.ranks: got .*; allowed: None \(all ranks\)"):
            parse_sections({"monitor": {"ranks": bad}})


def test_plain_loop_lines_carry_the_rank_when_there_are_several(tmp_path, caplog):
    """Outside MindFormers (whose logger writes rank_<r>/ files), mindmon's own lines say their rank,
    and a group left to find its rank writes under it. A DataParallel of size 2 stands for an msrun rank."""
    import logging

    from mindmon import parse_sections
    from mindmon.parallel.data_parallel import DataParallel
    from mindmon.core.factory import build_group

    two_ranks = DataParallel()
    two_ranks.size, two_ranks.rank = 2, 1
    config = parse_sections({"monitor": {"output_dir": str(tmp_path), "train_state": {"device_loss": True}}})
    group = build_group(config, data_parallel=two_ranks)
    assert group.rank == 1
    with caplog.at_level(logging.INFO, logger="mindmon"):
        group.setup()
        group.record("device_loss", 2.5)
        group.flush(step=3)
        group.close()
    assert '[rank 1] { "step": 3, "device_loss": 2.5 }' in caplog.messages
    assert read_jsonl(tmp_path / "rank_1" / "metrics.jsonl")[0]["rank"] == 1
    single = build_group(config, logger=None)
    assert single.rank == 0 and single.logger is logging.getLogger("mindmon")
