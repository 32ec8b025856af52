"""The columnar output: the same records as the JSONL (NaN and inf kept), written a step at a time so a
SIGKILL loses at most the step in flight, at least 5x smaller, and `mindmon compact` from a JSONL run."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mindmon.config import ConfigError
from mindmon.features import parse_sections
from mindmon.core.engine import RunInfo
from mindmon.formats import columnar, jsonl
from mindmon.core.records import Record, TensorStatsRecord
from mindmon.sinks import JsonlSink
from mindmon.sinks.columnar import ColumnarSink
from tests.support import HERE

JOB = Path(HERE) / "scripts" / "plain_loop_job.py"
NAN, INF = float("nan"), float("inf")

STEPS = {
    1: [Record(1, 0, 0, "local_loss", "loss", 2.5), Record(1, 1, 0, "local_loss", "loss", NAN),
        Record(1, 0, 0, "local_norm", "layer.weight", -INF), Record(1, None, 0, "grad_norm", "global", INF),
        Record(1, 0, 0, "tokens_per_expert", "decoder.layers.1", [5, 3, 4, 4], iteration=0),
        Record(1, None, 0, "samples", "consumed", 8)],
    2: [Record(2, None, 0, "max_attention_logit", "decoder.layers.0.max_logits_val", [1.5, NAN, INF, -INF]),
        TensorStatsRecord(2, None, 0, "grad_reduced", "fc1.weight", [-0.53, 0.75, NAN], ops=("min", "max", "norm"),
                          shape=(8, 4), dtype="Float32"),
        TensorStatsRecord(2, 1, 0, "actv", "fc1/output", [], ops=(), shape=(), dtype="Float16"),
        Record(2, None, 0, "device_loss", "loss", 1e-300 * 1e-300), Record(2, None, 0, "device_loss", "x", -0.0)],
}


def same(a, b) -> bool:
    """Equal numbers, NaN equal to NaN, -0.0 apart from 0.0."""
    return repr(float(a)) == repr(float(b))


def assert_same_records(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (type(g), g.step, g.micro_step, g.rank, g.kind, g.name, g.iteration) == \
               (type(w), w.step, w.micro_step, w.rank, w.kind, w.name, w.iteration)
        if isinstance(w.value, list):
            assert isinstance(g.value, list) and len(g.value) == len(w.value)
            assert all(same(x, y) for x, y in zip(g.value, w.value)), (g, w)
        else:
            assert same(g.value, w.value), (g, w)
        if isinstance(w, TensorStatsRecord):
            assert (g.ops, g.shape, g.dtype) == (w.ops, w.shape, w.dtype)


def write_both(root, steps=STEPS):
    sinks = [JsonlSink(str(root)), ColumnarSink(str(root), coordinates={"dp": 0, "pp": 1})]
    for sink in sinks:
        sink.open(RunInfo(0))
    for records in steps.values():
        for sink in sinks:
            sink.write(records)
            sink.flush()
    for sink in sinks:
        sink.close()


def test_columnar_equals_jsonl_record_for_record(tmp_path):
    write_both(tmp_path)
    folder = tmp_path / "rank_0"
    assert sorted(os.listdir(folder)) == ["metrics.jsonl", "metrics.parquet"]   # the stream was compacted, lock gone
    want = [r for records in STEPS.values() for r in records]
    from_jsonl = jsonl.read_records(str(folder / "metrics.jsonl"))
    assert_same_records(from_jsonl, want)
    assert_same_records(columnar.read_records(str(folder / "metrics.parquet")), want)
    table = columnar.read_table(str(folder / "metrics.parquet"))
    assert table.schema == columnar.schema()
    assert set(table.column("dp").to_pylist()) == {0} and set(table.column("pp").to_pylist()) == {1}
    assert set(table.column("tp").to_pylist()) == {None}


def test_compact_turns_a_jsonl_run_into_the_same_records(tmp_path):
    sink = JsonlSink(str(tmp_path / "monitor"))
    sink.open(RunInfo(3))
    for records in STEPS.values():
        sink.write([Record(r.step, r.micro_step, 3, r.kind, r.name, r.value, r.iteration) if type(r) is Record
                    else TensorStatsRecord(r.step, r.micro_step, 3, r.kind, r.name, r.value, r.iteration, r.ops,
                                           r.shape, r.dtype) for r in records])
    sink.close()
    with open(tmp_path / "monitor" / "rank_3" / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "micro_step": 0, "rank": 3, "ki')   # a line cut by a kill
    result = subprocess.run([sys.executable, "-m", "mindmon", "compact", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "1 rank(s)" in result.stdout
    path = tmp_path / "monitor" / "rank_3" / "metrics.parquet"
    assert_same_records(columnar.read_records(str(path)), jsonl.read_records(str(path.with_suffix(".jsonl"))))


def _train_state_step(step: int, rank: int, rng) -> list:
    """The demo's train_state step: 111 parameters, K = 4: 1004 records."""
    names = [f"decoder.layers.{i // 5}.part_{i % 5}.weight" for i in range(111)]
    records = []
    for k in range(4):
        for kind in ("local_norm", "micro_norm"):
            records += [Record(step, k, rank, kind, n, float(v)) for n, v in zip(names, rng.lognormal(-3, 1, 111))]
        records.append(Record(step, k, rank, "local_loss", "loss", float(2 + rng.standard_normal())))
    records += [Record(step, None, rank, "device_norm", n, float(v)) for n, v in zip(names, rng.lognormal(-3, 1, 111))]
    return records + [Record(step, None, rank, "device_loss", "loss", float(2 + rng.standard_normal()))]


def test_parquet_is_at_least_5x_smaller_than_the_jsonl(tmp_path):
    rng = np.random.default_rng(0)
    write_both(tmp_path, {s: _train_state_step(s, 0, rng) for s in range(1, 31)})
    jsonl_bytes = os.path.getsize(tmp_path / "rank_0" / "metrics.jsonl")
    parquet_bytes = os.path.getsize(tmp_path / "rank_0" / "metrics.parquet")
    print(f"30 steps x 1004 records: JSONL {jsonl_bytes} B ({jsonl_bytes / 30120:.1f} B/record), Parquet "
          f"{parquet_bytes} B ({parquet_bytes / 30120:.1f} B/record): {jsonl_bytes / parquet_bytes:.1f}x smaller")
    assert parquet_bytes * 5 <= jsonl_bytes


def test_killed_process_loses_at_most_the_step_in_flight(tmp_path):
    job = subprocess.Popen([sys.executable, str(JOB), str(tmp_path), "10000", "0", "parquet"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        printed = [job.stdout.readline() for _ in range(3)]
        assert all(line.startswith("step") for line in printed)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    stream = tmp_path / "rank_0" / "metrics.arrows"
    assert stream.exists() and not (tmp_path / "rank_0" / "metrics.parquet").exists()
    whole = stream.read_bytes()
    with open(stream, "ab") as handle:   # a batch cut by the kill: the first half of the last one again
        handle.write(whole[len(whole) // 2:len(whole) // 2 + 300])
    records = [r for batch in columnar.stream_batches(str(stream)) for r in columnar.records_of(batch)]
    steps = sorted({r.step for r in records})
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3   # step 3 was printed after its flush
    for step in steps:   # each step is whole: K = 2 local losses, both device norms, the device loss
        kinds = [r.kind for r in records if r.step == step]
        assert kinds.count("local_loss") == 2 and kinds.count("device_norm") == 2 and kinds.count("device_loss") == 1
    result = subprocess.run([sys.executable, "-m", "mindmon", "compact", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not stream.exists()
    assert_same_records(columnar.read_records(str(tmp_path / "rank_0" / "metrics.parquet")), records)


def test_a_resumed_run_keeps_the_steps_it_continues(tmp_path):
    """Run 1 wrote steps 1 and 2 and was killed; the run resumed from step 1's checkpoint writes step 2
    again: the file holds run 1's step 1 and the resumed run's step 2, once."""
    again = [Record(2, None, 0, "device_loss", "loss", 9.5)]
    sink = ColumnarSink(str(tmp_path))
    sink.open(RunInfo(0))
    for records in STEPS.values():
        sink.write(records)
        sink.flush()
    sink._stream.close()   # killed: the stream stays
    resumed = ColumnarSink(str(tmp_path))
    resumed.open(RunInfo(0, start_step=1))
    assert (tmp_path / "rank_0" / "metrics.parquet").exists()   # the killed run's stream, compacted first
    resumed.write(again)
    resumed.flush()
    resumed.close()
    assert_same_records(columnar.read_records(str(tmp_path / "rank_0" / "metrics.parquet")), STEPS[1] + again)


@pytest.mark.parametrize("value, message", [
    ([], "monitor.metrics_formats: got [] (list); allowed: a non-empty list of distinct names from ['jsonl', 'parquet']"),
    (["csv"], "monitor.metrics_formats: got ['csv'] (list); allowed: a non-empty list"),
    (["jsonl", "jsonl"], "monitor.metrics_formats: got ['jsonl', 'jsonl'] (list); allowed:"),
    (3, "monitor.metrics_formats: got 3 (int); allowed:"),
])
def test_bad_metrics_formats_name_the_key(value, message):
    with pytest.raises(ConfigError) as error:
        parse_sections({"monitor": {"metrics_formats": value}})
    assert str(error.value).startswith(message)
    assert parse_sections({"monitor": {"metrics_formats": "parquet"}}).monitor.metrics_formats == ("parquet",)
    assert parse_sections({}).monitor.metrics_formats == ("jsonl",)


def test_a_missing_engine_is_one_line_naming_the_extra(tmp_path):
    write_both(tmp_path)
    blocked = ("import sys; sys.modules['duckdb'] = None; from mindmon.cli import main; "
               f"sys.exit(main(['query', {str(tmp_path)!r}, 'SELECT 1']))")
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("mindmon query: this feature needs duckdb") and "mindmon[analysis]" in result.stderr
    sink_blocked = ("import sys; sys.modules['pyarrow'] = None\nfrom mindmon.sinks.columnar import ColumnarSink\n"
                    "from mindmon.core.engine import RunInfo\n"
                    f"ColumnarSink({str(tmp_path / 'x')!r}).open(RunInfo(0))")
    result = subprocess.run([sys.executable, "-c", sink_blocked], capture_output=True, text=True, timeout=120)
    assert "ConfigError: monitor.metrics_formats: got 'parquet', which needs pyarrow" in result.stderr
    assert "mindmon[analysis]" in result.stderr
