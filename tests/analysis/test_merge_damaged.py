"""`mindmon merge` and `mindmon query` on a run with one damaged rank, its files written by mindmon's own sinks:
a `metrics.parquet` cut short (a killed copy) is named in one line and the rank read from its `metrics.jsonl`
instead, or left out without one; a `metrics.jsonl` that is not JSON lines at all is named and left out. The
other ranks' rows are checked against numpy over the values that were written."""
import csv
import io
import os
import subprocess
import sys

import numpy as np
import pytest

from mindmon.analysis.merge import merge
from mindmon.core.engine import RunInfo
from mindmon.core.records import Record
from mindmon.sinks import JsonlSink

RANKS, STEPS, K = 3, 4, 2
NAMES = ("a.weight", "b.weight")


def write_run(root, formats=("jsonl", "parquet")):
    """Every rank's records through JsonlSink and ColumnarSink; returns {(kind, name, step, micro): {rank: value}}."""
    from mindmon.sinks.columnar import ColumnarSink

    rng = np.random.default_rng(3)
    written = {}
    for rank in range(RANKS):
        sinks = ([JsonlSink(str(root))] if "jsonl" in formats else []) + \
                ([ColumnarSink(str(root))] if "parquet" in formats else [])
        for sink in sinks:
            sink.open(RunInfo(rank))
        for step in range(1, STEPS + 1):
            records = [Record(step, k, rank, "local_loss", "loss", float(rng.uniform(1, 3))) for k in range(K)]
            records += [Record(step, None, rank, "device_norm", name, float(rng.lognormal(-2, 1))) for name in NAMES]
            for sink in sinks:
                sink.write(records)
                sink.flush()
            for r in records:
                written.setdefault((r.kind, r.name, r.step, r.micro_step), {})[rank] = r.value
        for sink in sinks:
            sink.close()
    return written


def cut(path):
    """A copy killed half way: the file's first half, no footer."""
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)


def merged(path):
    with open(path, newline="") as handle:
        return {(r["kind"], r["name"], int(r["step"]), None if r["micro_step"] == "" else int(r["micro_step"])): r
                for r in csv.DictReader(handle)}


def check_rows(rows, written, ranks):
    """Every key's row: min, max and mean of the named ranks' written values, computed here by numpy."""
    assert set(rows) == set(written)
    for key, per_rank in written.items():
        values = np.array([per_rank[r] for r in ranks])
        row = rows[key]
        assert int(row["ranks"]) == len(ranks)
        assert (float(row["min"]), float(row["max"])) == (values.min(), values.max())
        assert float(row["mean"]) == pytest.approx(values.mean(), rel=1e-15, abs=0)
        assert int(row["max_rank"]) == ranks[int(np.argmax(values))]


def test_a_cut_parquet_file_is_named_and_its_rank_read_from_the_jsonl(tmp_path):
    written = write_run(tmp_path)
    parquet = tmp_path / "rank_1" / "metrics.parquet"
    cut(parquet)
    said = io.StringIO()
    path, _ = merge(str(tmp_path), progress=said)
    lines = said.getvalue().splitlines()
    named = [line for line in lines if "rank 1:" in line]
    assert len(named) == 1
    assert named[0].startswith(f"mindmon: rank 1: {parquet} cannot be read (cut short? ")
    assert "No magic bytes found at end of file" in named[0]
    assert named[0].endswith(f"); read {tmp_path / 'rank_1' / 'metrics.jsonl'} instead")
    assert lines[-1] == f"mindmon merge: steps 1-{STEPS} (1/1) from {RANKS} rank(s)"
    check_rows(merged(path), written, [0, 1, 2])


def test_a_cut_parquet_file_without_jsonl_leaves_only_its_rank_out(tmp_path):
    written = write_run(tmp_path, formats=("parquet",))
    parquet = tmp_path / "rank_1" / "metrics.parquet"
    cut(parquet)
    said = io.StringIO()
    path, _ = merge(str(tmp_path), progress=said)
    named = [line for line in said.getvalue().splitlines() if "rank 1:" in line]
    assert len(named) == 1 and named[0].startswith(f"mindmon: rank 1: {parquet} cannot be read (cut short? ")
    assert named[0].endswith("); its rows are left out")
    check_rows(merged(path), written, [0, 2])


def test_query_on_a_cut_parquet_file_names_the_rank_and_answers_for_the_others(tmp_path):
    written = write_run(tmp_path, formats=("parquet",))
    parquet = tmp_path / "rank_2" / "metrics.parquet"
    cut(parquet)
    query = "SELECT rank, count(*) AS n, sum(value) AS total FROM records GROUP BY rank ORDER BY rank"
    result = subprocess.run([sys.executable, "-m", "mindmon", "query", str(tmp_path), query, "-o",
                             str(tmp_path / "out.csv")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"mindmon: rank 2: {parquet} cannot be read (cut short? ")
    assert lines[0].endswith("); its rows are left out") and lines[1] == f"mindmon query: wrote {tmp_path / 'out.csv'}"
    with open(tmp_path / "out.csv", newline="") as handle:
        got = [(int(r["rank"]), int(r["n"]), float(r["total"])) for r in csv.DictReader(handle)]
    assert [(rank, n) for rank, n, _ in got] == [(0, len(written)), (1, len(written))]
    for rank, _, total in got:
        assert total == pytest.approx(sum(per_rank[rank] for per_rank in written.values()), rel=1e-12)


def test_a_jsonl_that_is_not_json_lines_is_named_and_the_other_ranks_kept(tmp_path):
    written = write_run(tmp_path, formats=("jsonl",))
    broken = tmp_path / "rank_0" / "metrics.jsonl"
    broken.write_text("step,kind,name,value\n1,local_loss,loss,2.5\n2,local_loss,loss,2.4\n")
    said = io.StringIO()
    path, _ = merge(str(tmp_path), progress=said)
    assert said.getvalue().splitlines() == [
        f"mindmon: rank 0: {broken} has no line that is a record (not JSON lines?); rank 0 is left out",
        f"mindmon merge: steps 1-{STEPS} (1/1) from 2 rank(s)"]
    check_rows(merged(path), written, [1, 2])


def test_a_run_with_no_readable_file_is_one_line_and_exit_code_1(tmp_path):
    write_run(tmp_path, formats=("parquet",))
    for rank in range(RANKS):
        cut(tmp_path / f"rank_{rank}" / "metrics.parquet")
    result = subprocess.run([sys.executable, "-m", "mindmon", "merge", str(tmp_path)], capture_output=True,
                            text=True, timeout=300)
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert [line.split(":")[1] for line in lines[:RANKS]] == [f" rank {r}" for r in range(RANKS)]
    assert lines[RANKS:] == [f"mindmon merge: no readable records file at or below {str(tmp_path)!r} "
                             f"(each one is named above)"]
    assert not (tmp_path / "merged.csv").exists()
