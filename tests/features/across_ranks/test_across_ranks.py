"""monitor.across_ranks on four real msrun workers (data parallel over mccl on CPU, each rank its own
sequences): rank 0's `across_ranks` records equal numpy's min, mean, max, argmin and argmax over the four
ranks' own JSONL values, and its TensorBoard holds the same numbers under `across_ranks/...` tags, read
back with TensorBoard's EventAccumulator. The other ranks write none."""
from collections import defaultdict

import numpy as np
import pytest

from tests.support.across_ranks_worker import K
from tests.support.jsonl import read_jsonl
from tests.support.msrun_launch import run_workers
from tests.sinks.test_tensorboard import scalars

pytestmark = pytest.mark.serial   # 4 msrun ranks

RANKS, STEPS = 4, 3
STATISTICS = ("min", "mean", "max", "min_rank", "max_rank")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("across_ranks")
    result, logs = run_workers("across_ranks_worker.py", [root / "out", STEPS, 1], root, RANKS)
    assert result.returncode == 0, result.stdout[-2000:] + "".join(log[-2000:] for log in logs.values())
    for rank in range(RANKS):
        assert f"across_ranks_worker rank {rank}: ok" in logs[rank], logs[rank][-2000:]
    return root / "out", {rank: read_jsonl(root / "out" / f"rank_{rank}" / "metrics.jsonl") for rank in range(RANKS)}


def own_values(rows):
    """{(step, micro_step, column name): value} of one rank, derived from its own records as the docs
    define each column (device_loss: the mean of its K losses; accumulated_norm: the sum of its local_norm
    increments, A_{K-1}; tokens: its micro-steps' tokens_per_expert summed)."""
    values = defaultdict(float)
    for r in rows:
        step, micro, kind, name, value = r["step"], r["micro_step"], r["kind"], r["name"], r["value"]
        if kind == "local_loss":
            values[(step, micro, "local_loss")] = value
            values[(step, None, "device_loss")] += value / K
        elif kind == "micro_norm":
            values[(step, micro, f"micro_norm/{name}")] = value
        elif kind == "local_norm":
            values[(step, None, f"accumulated_norm/{name}")] += value
        elif kind == "tokens_per_expert":
            for expert, tokens in enumerate(value):
                values[(step, None, f"tokens_per_expert_step/{name}/expert_{expert}")] += tokens
    return values


def expected_summaries(per_rank):
    ranks = [own_values(per_rank[rank]) for rank in range(RANKS)]
    assert all(set(r) == set(ranks[0]) for r in ranks)
    expected = {}
    for (step, micro, column) in ranks[0]:
        column_values = np.array([r[(step, micro, column)] for r in ranks])
        rounded = column_values.astype(np.float32)   # the all-reduce carries float32
        for statistic, value in zip(STATISTICS, (column_values.min(), column_values.mean(), column_values.max(),
                                                 rounded.argmin(), rounded.argmax())):
            expected[(step, micro, f"{column}/{statistic}")] = float(value)
    return expected


def across_records(rows):
    got = {}
    for r in rows:
        if r["kind"] == "across_ranks":
            key = (r["step"], r["micro_step"], r["name"])
            assert key not in got, f"{key} written twice"
            got[key] = r["value"]
    return got


def test_rank_0_summaries_equal_numpy_over_the_ranks_own_values(run):
    _, per_rank = run
    got, expected = across_records(per_rank[0]), expected_summaries(per_rank)
    assert sorted(got, key=str) == sorted(expected, key=str)
    kinds = {name.split("/")[0] for _, _, name in got}
    assert kinds == {"local_loss", "device_loss", "micro_norm", "accumulated_norm", "tokens_per_expert_step"}
    for key, want in expected.items():
        assert abs(got[key] - want) <= 1e-6 * abs(want) + 1e-9, (key, got[key], want)
    # The ranks differ (their own sequences), so the check above could fail: not every extreme is rank 0's.
    assert {v for (_, _, name), v in got.items() if name.endswith("/max_rank")} - {0.0}
    for rank in range(1, RANKS):
        assert not across_records(per_rank[rank]), f"rank {rank} wrote across_ranks records"


def test_the_mean_device_loss_is_the_data_parallel_device_loss(run):
    _, per_rank = run
    got = across_records(per_rank[0])
    for r in per_rank[0]:
        if r["kind"] == "device_loss":
            assert abs(got[(r["step"], None, "device_loss/mean")] - r["value"]) <= 1e-6 * abs(r["value"])


def test_tensorboard_of_rank_0_shows_the_summaries(run):
    out, per_rank = run
    tags = scalars(out / "tensorboard" / "rank_0")
    got = across_records(per_rank[0])
    assert {t for t in tags if t.startswith("across_ranks/")} == {f"across_ranks/{name}" for _, _, name in got}
    for (step, micro, name), value in got.items():
        x = step if micro is None else (step - 1) * K + micro   # micro-step values on the global micro-step
        assert tags[f"across_ranks/{name}"][x] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, micro, name)
    for rank in range(1, RANKS):
        assert not [t for t in scalars(out / "tensorboard" / f"rank_{rank}") if t.startswith("across_ranks/")]


def test_the_offline_readers_take_the_summaries(run, tmp_path):
    """mindmon's own JSONL reader and `mindmon query` (DuckDB) give back what rank 0 wrote."""
    import csv

    from mindmon.analysis.query import run_query
    from mindmon.formats.jsonl import metrics_path, read_records

    out, per_rank = run
    got = across_records(per_rank[0])
    records = [r for r in read_records(metrics_path(str(out), 0)) if r.kind == "across_ranks"]
    assert {(r.step, r.micro_step, r.name): r.value for r in records} == got
    table = tmp_path / "across.csv"
    run_query(str(out), "SELECT step, micro_step, rank, name, value FROM records WHERE kind = 'across_ranks'",
              str(table))
    with open(table) as handle:
        rows = list(csv.DictReader(handle))
    assert {row["rank"] for row in rows} == {"0"}
    assert {(int(row["step"]), int(row["micro_step"]) if row["micro_step"] else None, row["name"]):
            float(row["value"]) for row in rows} == got


def test_the_report_section_counts_the_maxima_and_draws_the_loss_band(run, tmp_path):
    from collections import Counter

    from mindmon.analysis.live_summaries import TOP, loss_band, most_often_max
    from mindmon.analysis.report import write_report
    from mindmon.analysis.sql import Engine

    out, per_rank = run
    got = across_records(per_rank[0])
    counts = Counter((int(v), name.split("/")[0]) for (_, _, name), v in got.items() if name.endswith("/max_rank"))
    want = sorted(((rank, what, n) for (rank, what), n in counts.items()), key=lambda t: (-t[2], t[0], t[1]))[:TOP]
    with Engine(str(out)) as engine:
        assert most_often_max(engine) == want
        band = loss_band(engine)
    assert [row[0] for row in band] == sorted(row[0] for row in band)   # by step
    assert sorted(band) == sorted((s, name, v) for (s, _, name), v in got.items()
                                  if name in ("device_loss/min", "device_loss/mean", "device_loss/max"))
    assert len(band) == 3 * STEPS
    page = open(write_report(str(out), str(tmp_path / "report.html"), progress=None), encoding="utf-8").read()
    assert '<img alt="loss band across ranks"' in page
    assert f"<tr><td>{want[0][0]}</td><td>{want[0][1]}</td><td>{want[0][2]}</td></tr>" in page
