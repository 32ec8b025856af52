"""The overhead benchmark runs and writes its JSON; monitors make no host read inside the step's
record calls on the device path, and read each tensor once on the CPU path. No timing is asserted."""
import glob
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mindspore import Tensor, nn

from tests.support.demo_trainer import SMALL_MODEL, make_model
from tests.support.jsonl import read_jsonl
from mindmon import AccumulatingTrainStep, build_group, compat, parse_sections, split_batch
from mindmon.demo.data import make_sequences
from mindmon.formats.msprobe_csv import read_csv

pytestmark = pytest.mark.serial   # times the monitors' overhead

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["off", "train_state", "+moe+max_logits", "host_sync_ref", "tensor_stats", "activations", "activations_idle",
           "l2_features", "speed", "speed+flops", "off@device", "train_state@device", "tensor_stats@device"]
K = 2  # micro-steps per step in the benchmark's --tiny size


def test_benchmark_runs_at_a_tiny_size_and_writes_the_table_as_json(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_overhead.py"), "--tiny", "--rounds", "2", "--steps-per-block", "1",
         "--warmup", "1", "--scaling-layers", "2", "--scaling-rounds", "1", "--seq-lengths", "12",
         "--seq-configs", "tensor_stats", "activations", "--peers", "--peer-steps", "1", "--json", str(out),
         "--output-dir", str(tmp_path / "monitor")], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {row["config"]: row for row in data["main"]["rows"]}
    assert list(rows) == CONFIGS
    assert rows["off"]["ratio_to_off"] == 1.0 and rows["off"]["added_ms_per_step"] == 0.0
    for name, row in rows.items():   # each against the unmonitored step of its own path
        baseline = rows["off@device" if name.endswith("@device") else "off"]
        assert row["steps_timed"] == 2 and row["median_step_s"] > 0 and row["median_cpu_s"] > 0
        assert row["ratio_to_off"] == pytest.approx(row["median_step_s"] / baseline["median_step_s"])
        assert row["mindmon_kernels_per_step"] == row["kernels_per_step"] - baseline["kernels_per_step"]
    assert rows["off"]["in_mindmon_ms_per_step"] == 0.0 and rows["train_state"]["in_mindmon_ms_per_step"] > 0
    tensors = data["main"]["size"]["parameter_tensors"]
    # Kernels a step, counted by MindSpore's profiler: the host path's monitoring launches none (numpy).
    for name in ("train_state", "tensor_stats", "activations", "speed", "speed+flops"):
        assert rows[name]["mindmon_kernels_per_step"] == 0 < rows[name]["kernels_per_step"], name
    # The device path: train_state's norms take 5 kernels per gradient set (a concatenation, the squares,
    # three levels of segment sums): the accumulated gradient's at micro-step 0, the accumulated and the
    # micro-batch gradient's at each later one; then the step's one transfer (a concatenation).
    assert rows["train_state@device"]["mindmon_kernels_per_step"] == 5 + 10 * (K - 1) + 1
    # tensor_stats: 13 kernels at each of five points (param_origin, param_updated, grad_reduced, exp_avg,
    # exp_avg_sq), 12 for grad_unreduced's statistics (its sums are already one flat tensor: no concatenation),
    # one transfer, and the gradient sums themselves: one concatenation at the first micro-batch, a
    # concatenation and one add at each later one. None of it grows with the number of tensors.
    assert tensors > 13
    assert rows["tensor_stats@device"]["mindmon_kernels_per_step"] == 5 * 13 + 12 + 1 + 1 + 2 * (K - 1)
    assert ("device path (on_host=False) against the host path: train_state@device" in result.stdout
            and "kernels/step" in result.stdout and "share of off" in result.stdout)
    for name in ("speed", "speed+flops"):   # the speed feature's own records, in its own metrics file
        kinds = {r["kind"] for r in read_jsonl(tmp_path / "monitor" / name / "rank_0" / "metrics.jsonl")}
        assert {"step_time", "throughput"} <= kinds and ("flops" in kinds) == (name == "speed+flops")
        assert rows[name]["in_mindmon_ms_per_step"] > 0
    assert "gc ms mean" in result.stdout and all(row["collector_ms_per_step_mean"] >= 0 for row in rows.values())
    assert [run["num_layers"] for run in data["scaling"]] == [2]
    assert [row["config"] for row in data["scaling"][0]["rows"]] == ["off", "train_state"]
    assert data["settings"]["pynative_synchronize"] is True
    assert "host_sync_ref / train_state (train_state's add measured apart): added wall time" in result.stdout
    apart = data["main"]["norms_in_add"]   # the add of the K captured micro-batches, with and without norms
    assert apart["repeats"] == 7 and apart["add_ms"] > 0 and apart["add_with_norms_ms"] > 0
    assert "train_state's add measured apart" in result.stdout
    floor = data["main"]["statistics_floor"]   # numpy's gradient sum and one read of the six points
    assert floor["repeats"] == 7 and floor["gradient_sum_ms"] > 0 and floor["one_read_ms"] > 0
    assert floor["floor_ms"] == pytest.approx(floor["gradient_sum_ms"] + floor["one_read_ms"])
    assert floor["gradient_sum_arriving_ms"] > 0 and 0 < floor["sums_read_ms"] < floor["one_read_ms"]
    assert "tensor_stats' memory floor (numpy, fastest of 7): the gradient sum" in result.stdout
    # activations' floor: one read of every tensor of the last collected step's actv and actv_grad rows
    actv_floor = data["main"]["activation_floor"]
    last_rows = [row for point in ("actv", "actv_grad") for row in
                 read_csv(sorted(glob.glob(str(tmp_path / "monitor" / "activations" / "*-rank0-*" / f"{point}_3-3.csv")))[0])]
    assert actv_floor["tensors"] == len(last_rows) > 0 and actv_floor["one_read_ms"] > 0
    assert actv_floor["elements"] == sum(int(np.prod(row.shape)) for row in last_rows)
    assert actv_floor["read_by"] in ("dot", "max") and floor["read_by"] in ("dot", "max")
    assert "activations' memory floor (numpy, fastest of 7): one read by numpy's" in result.stdout
    # what their time in mindmon is made of: one HookBackward marker per input gradient row of a step
    gradient_rows = read_csv(sorted(glob.glob(str(tmp_path / "monitor" / "activations" / "*-rank0-*" /
                                              "actv_grad_3-3.csv")))[0])
    input_gradient_rows = [row for row in gradient_rows if re.search(r"\.input(_\d+)?$", row.name)]
    parts = rows["activations"]["parts_per_step"]
    assert parts["marker_calls"] == len(input_gradient_rows) > 0 and parts["markers"] > 0
    assert parts["adds"] == 0 and 0 < parts["reads"] + parts["markers"] < rows["activations"]["in_mindmon_ms_per_step"]
    # a marker's output is its input's memory, read once: fewer elements read than the rows hold
    assert 0 < parts["read_elements"] < actv_floor["elements"]
    assert f"they read {parts['read_elements']:,.0f} of the floor's {actv_floor['elements']:,} elements" in result.stdout
    parts = rows["tensor_stats"]["parts_per_step"]   # the gradient sums' adds, the other points' reads
    assert parts["marker_calls"] == 0 and parts["adds"] > 0 and parts["reads"] > 0
    assert parts["adds"] + parts["reads"] < rows["tensor_stats"]["in_mindmon_ms_per_step"]
    assert "of it (medians of steps): the compiled adds" in result.stdout
    assert "of it (medians of steps): the compiled reads" in result.stdout
    # the sequence run: each statistics configuration against its own floor, measured at that length
    longer = data["sequence"][0]
    assert longer["seq_length"] == 12 and [row["config"] for row in longer["rows"]] == [
        "off", "train_state", "tensor_stats", "activations"]
    assert longer["statistics_floor"]["floor_ms"] > 0
    longer_rows = [row for point in ("actv", "actv_grad") for row in read_csv(glob.glob(   # its last step
        str(tmp_path / "monitor" / "S12" / "activations" / "*-rank0-*" / f"{point}_1-1.csv"))[0])]
    assert longer["activation_floor"]["elements"] == sum(int(np.prod(row.shape)) for row in longer_rows)
    assert longer["activation_floor"]["elements"] > actv_floor["elements"]   # 12 tokens a sequence, not 8
    assert re.search(r"\n\s+12  tensor_stats .*x\n", result.stdout)
    peers = {row["implementation"]: row for row in data["peers"]}
    assert peers["mindmon"]["on_median_s"] > 0 and peers["mindmon"]["off_median_s"] > 0
    # Each monitored configuration really monitored: every step (warm-up, 2 timed, 1 memory step, 1 step
    # whose kernels are counted, and for train_state the step whose adds are measured apart) has a
    # local_norm per parameter tensor per micro-step, in its own metrics file.
    for config, steps in (("train_state", 6), ("+moe+max_logits", 5), ("host_sync_ref", 5), ("train_state@device", 5)):
        records = read_jsonl(tmp_path / "monitor" / config / "rank_0" / "metrics.jsonl")
        assert sum(r["kind"] == "local_norm" for r in records) == steps * K * tensors
    moe = read_jsonl(tmp_path / "monitor" / "+moe+max_logits" / "rank_0" / "metrics.jsonl")
    assert {r["kind"] for r in moe} >= {"tokens_per_expert", "max_attention_logit"}
    # tensor_stats: msprobe's CSVs of every point, one row per parameter tensor per step.
    grads = glob.glob(str(tmp_path / "monitor" / "tensor_stats" / "*-rank0-*" / "grad_reduced_*.csv"))
    assert len(grads) == 5 and rows["tensor_stats"]["in_mindmon_ms_per_step"] > 0
    for point in ("param_origin", "param_updated", "grad_unreduced", "exp_avg", "exp_avg_sq"):
        assert glob.glob(str(tmp_path / "monitor" / "tensor_stats" / "*-rank0-*" / f"{point}_0-0.csv")), point
    with open(sorted(grads)[0]) as handle:
        assert sum(1 for _ in handle) == 1 + tensors
    actv = glob.glob(str(tmp_path / "monitor" / "activations" / "*-rank0-*" / "actv_[0-9]*.csv"))
    assert len(actv) == 5 and rows["activations"]["in_mindmon_ms_per_step"] > 0
    # activations_idle: the same hooks run but collect nothing, so no statistics file is written
    assert not glob.glob(str(tmp_path / "monitor" / "activations_idle" / "**" / "actv*.csv"), recursive=True)
    assert 0 < rows["activations_idle"]["in_mindmon_ms_per_step"] < rows["activations"]["in_mindmon_ms_per_step"]
    l2 = read_jsonl(tmp_path / "monitor" / "l2_features" / "rank_0" / "metrics.jsonl")
    assert {r["kind"] for r in l2} >= {"attention_hook", "linear_hook"} and rows["l2_features"]["in_mindmon_ms_per_step"] > 0


def test_host_sync_reference_computes_the_same_norms(rng):
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_overhead import HostSyncPerParameterNorms

    tensors = [Tensor(rng.normal(size=s).astype(np.float32)) for s in [(3, 4), (70000,), (5,)]]
    reference = HostSyncPerParameterNorms()
    reference.add("g", tensors)
    expected = [np.sum(t.asnumpy().astype(np.float64) ** 2) for t in tensors]
    np.testing.assert_allclose(reference.results()["g"], expected, rtol=1e-5)


class _HostReads:
    """Counts Tensor.asnumpy calls (a spy that calls through) made while the step is inside a group call (its
    events, records and step end)."""

    def __init__(self, monkeypatch, group):
        self.in_record, self.in_flush, self.outside, self._where = 0, 0, 0, None
        original = Tensor.asnumpy

        def asnumpy(tensor):
            if self._where == "record":
                self.in_record += 1
            elif self._where == "flush":
                self.in_flush += 1
            else:
                self.outside += 1
            return original(tensor)

        monkeypatch.setattr(Tensor, "asnumpy", asnumpy)
        for name, where in (("reset", "record"), ("record", "record"), ("emit", "record"), ("flush", "flush")):
            setattr(group, name, self._inside(getattr(group, name), where))

    def _inside(self, method, where):
        def call(*args, **kwargs):
            outer, self._where = self._where, where
            try:
                return method(*args, **kwargs)
            finally:
                self._where = outer   # a call inside another (the step-begin event resets the group) keeps its place
        return call


def _monitored_step(tmp_path, on_host, monkeypatch):
    model = make_model()
    model.set_train(True)
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-3)
    config = parse_sections({"monitor": {"output_dir": str(tmp_path), "moe_monitor": {"save_tokens_per_expert_interval": 1},
                                  "train_state": {"local_norm": True, "local_loss": True, "device_norm": True,
                                                  "device_loss": True}}})
    group = build_group(config, model=model, parameter_names=[p.name for p in optimizer.parameters],
                         on_host=on_host)
    group.setup()
    step = AccumulatingTrainStep(lambda ids, labels: model(ids, labels)[0], optimizer, 4, group=group,
                                 on_host=on_host)
    sequences = make_sequences(8, SMALL_MODEL["seq_length"], SMALL_MODEL["vocab_size"])
    for op in ("narrow", "split"):   # MindSpore's kernel probes read back once per process: not the step's reads
        compat._mint_runs(op)
    reads = _HostReads(monkeypatch, group)
    step(split_batch((Tensor(sequences[:, :-1]), Tensor(sequences[:, 1:])), 4))
    group.flush(1)
    group.close()
    records = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    return reads, len(optimizer.parameters), records


def test_device_path_reads_nothing_to_the_host_inside_the_step(tmp_path, monkeypatch):
    reads, tensors, records = _monitored_step(tmp_path, on_host=False, monkeypatch=monkeypatch)
    assert reads.in_record == 0
    # At flush: one transfer for every norm set of the step (accumulated and micro-batch gradient per
    # micro-step), one per micro-batch loss, one for the device loss, one for all MoE snapshots; never
    # one per parameter.
    assert reads.in_flush == 1 + 4 + 1 + 1 < tensors
    assert sum(r["kind"] == "local_norm" for r in records) == 4 * tensors


def test_cpu_path_reads_each_gradient_once_per_micro_step(tmp_path, monkeypatch):
    reads, tensors, records = _monitored_step(tmp_path, on_host=True, monkeypatch=monkeypatch)
    moe_layers = len({r["name"] for r in records if r["kind"] == "tokens_per_expert"})
    # Views of host memory: the step sums each micro-batch's gradients into its host buffer, reading
    # each gradient once; the norms (micro-batch, accumulated, the global norm) are taken from those
    # views and the buffer, with no further read. Inside the group: the MoE counts at step begin and
    # after each micro-step.
    assert moe_layers == 2
    assert reads.outside == 4 * tensors
    assert reads.in_record == (4 + 1) * moe_layers
    device = {r["name"]: r["value"] for r in records if r["kind"] == "device_norm"}
    increments = {}
    for r in records:
        if r["kind"] == "local_norm":
            increments[r["name"]] = increments.get(r["name"], 0.0) + r["value"]
    assert increments == pytest.approx(device, rel=1e-6)


def test_collector_clock_counts_the_time_of_a_collection():
    import gc
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_overhead import CollectorClock

    clock = CollectorClock()
    try:
        garbage = [[] for _ in range(200_000)]
        for a, b in zip(garbage, garbage[1:]):   # cycles: the collection has work to do
            a.append(b)
            b.append(a)
        del garbage, a, b
        before, start = clock.seconds, time.perf_counter()
        gc.collect()
        elapsed = time.perf_counter() - start
        assert 0 < clock.seconds - before <= elapsed
    finally:
        gc.callbacks.remove(clock._callback)

