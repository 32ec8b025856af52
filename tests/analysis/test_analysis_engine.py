"""The offline tools on DuckDB give what the pure-Python tools gave on the same files (tests/support/reference_tools.py
keeps those): merged.csv byte for byte from the JSONL and from Parquet, the anomaly order, the report's data,
to-tensorboard's scalars; `mindmon query` equals numpy over the records."""
import csv
import filecmp
import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from tests.support import reference_tools
from mindmon.analysis import merge as engine_merge
from mindmon.analysis.compact import compact_run
from mindmon.analysis.report import figure_records, rank_summary, nonfinite_summary
from mindmon.analysis.sql import Engine
from mindmon.analysis.to_tensorboard import rank_shape, run_shape
from mindmon.core.engine import RunInfo
from mindmon.formats import jsonl
from mindmon.core.records import Record
from mindmon.sinks import JsonlSink

RANKS, STEPS, K = 11, 6, 3


def _value(rng, rank, step, kind):
    """Norms and losses with the cases the rules care about: NaN, inf, a spike, negatives, ties."""
    if kind == "local_loss" and (rank, step) == (5, 4):
        return float("nan")
    if kind == "local_loss" and rank == 3 and step == 2:
        return 40.0
    if kind == "micro_norm" and step == 5:
        return float(rng.uniform(-1, 1))            # negatives: the rule's slow path
    if kind == "micro_norm" and step == 6:
        return 0.5 if rank < 6 else 0.0             # ties and zeros
    if kind == "device_norm" and (rank, step) == (2, 3):
        return float("inf")
    return float(rng.lognormal(-2, 1))


def write_run(root, ranks=RANKS, steps=STEPS):
    rng = np.random.default_rng(7)
    for rank in range(ranks):
        sink = JsonlSink(str(root / "monitor"))
        sink.open(RunInfo(rank))
        for step in range(1, steps + 1):
            records = []
            for k in range(K):
                for name in ("a.weight", "b.weight"):
                    records += [Record(step, k, rank, kind, name, _value(rng, rank, step, kind))
                                for kind in ("local_norm", "micro_norm")]
                records.append(Record(step, k, rank, "local_loss", "loss", _value(rng, rank, step, "local_loss")))
            records += [Record(step, None, rank, "device_norm", n, _value(rng, rank, step, "device_norm"))
                        for n in ("a.weight", "b.weight")]
            records += [Record(step, None, rank, "device_loss", "loss", float(rng.uniform(1, 3))),
                        Record(step, None, rank, "max_attention_logit", "l", [1.0, float(rank)]),
                        Record(step, None, rank, "samples", "consumed", 16 * step)]
            if rank != 7:   # a key some ranks lack
                records.append(Record(step, None, rank, "grad_norm", "global", float(rng.uniform())))
            sink.write(records)
            sink.flush()
        sink.close()
    return root / "monitor"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("engine_run"))


def test_merge_equals_the_python_merge_from_jsonl_and_from_parquet(run_dir, tmp_path, monkeypatch):
    want, want_flagged = reference_tools.merge(str(run_dir), str(tmp_path / "python.csv"))
    assert len(want_flagged) >= 5   # the spike, the NaN rank, negatives: the rules did run
    monkeypatch.setattr(engine_merge, "WINDOW_ROWS", 300)   # several windows of steps
    got, flagged = engine_merge.merge(str(run_dir), str(tmp_path / "jsonl.csv"), source="jsonl", progress=None)
    assert filecmp.cmp(want, got, shallow=False)
    assert repr(flagged) == repr(want_flagged)
    columnar_run = tmp_path / "columnar"
    write_run(columnar_run)
    compact_run(str(columnar_run), progress=None)
    got, flagged = engine_merge.merge(str(columnar_run), str(tmp_path / "parquet.csv"), source="columnar",
                                      progress=None)
    assert filecmp.cmp(want, got, shallow=False)
    assert repr(flagged) == repr(want_flagged)


def test_the_outlier_rule_vectorised_equals_the_rule(rng):
    """Rows of random signs, ties and NaNs: the block computation equals outlier() row by row."""
    import pyarrow as pa

    rows = []
    for i in range(400):
        n = int(rng.integers(2, 14))
        values = rng.choice([0.0, 0.5, 1.0, 7.0, -3.0, 40.0], size=n) if i % 2 else rng.normal(size=n) * 5
        if i % 17 == 0:
            values[rng.integers(n)] = np.nan
        rows.append((list(range(n)), values.tolist()))
    table = pa.table({"kind": ["micro_norm"] * len(rows), "name": ["w"] * len(rows), "step": list(range(len(rows))),
                      "micro_step": [0] * len(rows), "ranks": [r for r, _ in rows], "vals": [v for _, v in rows]})
    got, _ = engine_merge.window_rows(table, 5.0)
    for (ranks, values), row in zip(rows, got):
        want = reference_tools.outlier("micro_norm", dict(zip(ranks, values)), 5.0)
        assert row[-1] == ("" if want is None else want), (values, row)


def _entry(rank, step, micro, call, kind=None, tag="x", pp=0):
    entry = {"rank": rank, "step": step, "micro_step": micro, "pp_stage": pp, "vpp_stage": 0, "call_id": call,
             "tag_name": tag, "message": f"r{rank} s{step} c{call}"}
    if kind is not None:
        entry["kind"] = kind
    return entry


def test_the_anomaly_order_equals_the_python_order(tmp_path, rng):
    from mindmon.features.alerts import analyse

    kinds = [None, "actv", "local_loss", "grad_reduced", "device_norm", "exp_avg", "loss"]
    tags = ["m/rank0/output", "m/rank0/input_1", "m/rank0/output_grad", "w/exp_avg", "w", "a/b.c/d"]
    folder = tmp_path / "anomaly_detected"
    for rank in range(3):
        entries = {f"key {rank}/{i}": _entry(rank, int(rng.integers(1, 4)), [None, 0, 1][i % 3], int(rng.integers(3)),
                                             kinds[i % len(kinds)], tags[i % len(tags)], int(rng.integers(2)))
                   for i in range(40)}
        (folder / f"rank{rank}").mkdir(parents=True)
        (folder / f"rank{rank}" / "anomaly.json").write_text(json.dumps(entries))
    entries = reference_tools.read_dumps(str(folder))
    paths = analyse.dump_files(str(folder))
    for k, steps in ((200, None), (25, None), (10, {2, 3})):
        want = reference_tools.top_anomalies(entries, k, steps)
        assert analyse.top_anomalies(paths, k, steps) == want


def test_query_equals_numpy_over_the_records(run_dir, tmp_path):
    records = [r for _, path in jsonl.metrics_files(str(run_dir)) for r in jsonl.read_records(path)]
    losses = {}
    for r in records:
        if r.kind == "local_loss" and math.isfinite(r.value):
            losses.setdefault(r.rank, []).append(r.value)
    query = ("SELECT rank, count(*) AS n, max(value) AS top FROM records WHERE kind = 'local_loss' AND isfinite(value) "
             "GROUP BY rank ORDER BY rank")
    for source in ("jsonl", "columnar"):
        if source == "columnar":
            compact_run(str(run_dir), progress=None)
        result = subprocess.run([sys.executable, "-m", "mindmon", "query", str(run_dir), query, "--source", source,
                                 "--memory-limit", "256MB", "--threads", "2"], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        rows = list(csv.DictReader(io.StringIO(result.stdout)))
        assert [int(r["rank"]) for r in rows] == sorted(losses)
        for row in rows:
            values = losses[int(row["rank"])]
            assert int(row["n"]) == len(values) and float(row["top"]) == np.max(values)
    result = subprocess.run([sys.executable, "-m", "mindmon", "query", str(run_dir), "SELECT nope FROM records"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "nope" in result.stderr


def test_the_reports_data_equals_the_python_computation(run_dir):
    from mindmon.analysis.report import FIGURE_KINDS

    with Engine(str(run_dir), source="jsonl") as engine:
        for rank, path in jsonl.metrics_files(str(run_dir)):
            records = jsonl.read_records(path)
            want = [r for r in records if r.kind in FIGURE_KINDS]
            got = figure_records(engine, rank)
            assert [(r.step, r.micro_step, r.kind, r.name) for r in got] == \
                   [(r.step, r.micro_step, r.kind, r.name) for r in want]
            assert repr([r.value for r in got]) == repr([float(r.value) if not isinstance(r.value, list)
                                                         else [float(v) for v in r.value] for r in want])
            assert rank_shape(engine, rank) == run_shape(records)
            steps = sorted({r.step for r in records})
            assert rank_summary(engine, rank) == (len(records), steps[0], steps[-1], nonfinite_summary(records))


def test_the_cross_rank_view_is_numpys(run_dir):
    from mindmon.analysis import across_ranks

    records = [r for _, path in jsonl.metrics_files(str(run_dir)) for r in jsonl.read_records(path)]
    loss = np.full((RANKS, STEPS), np.nan)
    norms = np.zeros((RANKS, STEPS))
    for r in records:
        if r.kind == "device_loss":
            loss[r.rank, r.step - 1] = r.value
        if r.kind == "device_norm":
            norms[r.rank, r.step - 1] += r.value ** 2
    with Engine(str(run_dir), source="jsonl") as engine:
        ranks, span, matrix = across_ranks.heat_matrix(engine, across_ranks.loss_sql(engine))
        assert ranks == list(range(RANKS)) and span == (1, STEPS, 1)
        np.testing.assert_array_equal(matrix, loss)
        _, _, matrix = across_ranks.heat_matrix(engine, across_ranks.grad_norm_sql(engine))
        want = np.where(np.isfinite(norms), np.sqrt(norms), np.nan)   # a non-finite cell is NaN (drawn red)
        np.testing.assert_allclose(matrix, want, rtol=1e-12)
        bad = sorted((r for r in records if not isinstance(r.value, list) and not math.isfinite(r.value)),
                     key=lambda r: (r.step, float("inf") if r.micro_step is None else r.micro_step, r.rank))
        assert across_ranks.first_nonfinite(engine)[:4] == (bad[0].step, bad[0].micro_step, bad[0].rank, bad[0].kind)
        out = across_ranks.standing_out(engine, across_ranks.grad_norm_sql(engine))
        finite = np.where(np.isfinite(norms), np.sqrt(norms), np.nan)
        ratio = finite / np.nanmedian(finite, axis=0)
        counts = (~np.isfinite(norms)).sum(axis=1) + (ratio > across_ranks.FACTOR).sum(axis=1)
        want = sorted((int(r) for r in np.nonzero(counts)[0]), key=lambda r: (-counts[r], -np.nanmax(ratio[r]), r))
        assert [row[0] for row in out] == want[:across_ranks.TOP_RANKS] and 2 in want   # rank 2: its inf
        for rank, steps, worst, at in out:
            assert steps == counts[rank] and worst == pytest.approx(np.nanmax(ratio[rank]), rel=1e-12)
            assert at == int(np.nanargmax(ratio[rank])) + 1


def test_to_tensorboard_from_parquet_equals_from_jsonl(tmp_path):
    from tests.sinks.test_tensorboard import scalars

    run = write_run(tmp_path / "run", ranks=2, steps=3)
    for source in ("jsonl", "columnar"):
        if source == "columnar":
            compact_run(str(run), progress=None)
        result = subprocess.run([sys.executable, "-m", "mindmon", "to-tensorboard", str(run), "-o",
                                 str(tmp_path / source), "--source", source], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
    for rank in range(2):
        from_jsonl = scalars(tmp_path / "jsonl" / f"rank_{rank}")
        assert from_jsonl and scalars(tmp_path / "columnar" / f"rank_{rank}") == from_jsonl
        assert from_jsonl["local_loss"][0] == pytest.approx(jsonl.read_records(str(run / f"rank_{rank}" /
                                                                                   "metrics.jsonl"))[4].value)
