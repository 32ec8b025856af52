"""monitor.speed on four real msrun workers (data parallel over mccl on CPU, and TP=2 x DP=2): the rank slowed
by a sleep in its forward is named at exactly the slowed steps, and only it; a balanced run names none; rank
0's cross-rank figures of step time, phases and throughput equal numpy's min, mean, max and extreme ranks over
the four ranks' own records, under either layout."""
from collections import defaultdict

import numpy as np
import pytest

from tests.support.jsonl import read_jsonl
from tests.support.msrun_launch import run_workers

pytestmark = pytest.mark.serial   # 4 msrun ranks, one slowed by a sleep

RANKS, STEPS, SLOW_RANK, SLOW_STEPS, SLEEP = 4, 6, 2, (3, 4), 2.0
STATISTICS = ("min", "mean", "max", "min_rank", "max_rank")


def _run(root, slow_rank, slow_steps, steps, layout=()):
    result, logs = run_workers("speed_worker.py", [root / "out", steps, slow_rank,
                                                   ",".join(map(str, slow_steps)) or "-", SLEEP, *layout], root, RANKS)
    assert result.returncode == 0, result.stdout[-2000:] + "".join(log[-2000:] for log in logs.values())
    for rank in range(RANKS):
        assert f"speed_worker rank {rank}: ok" in logs[rank], logs[rank][-2000:]
    return {rank: read_jsonl(root / "out" / f"rank_{rank}" / "metrics.jsonl") for rank in range(RANKS)}


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("speed_slowed"), SLOW_RANK, SLOW_STEPS, STEPS)


def _slow_ranks(rows):
    return sorted((r["step"], r["name"]) for r in rows if r["kind"] == "slow_rank")


def test_the_slowed_rank_is_named_at_the_slowed_steps_only(slowed):
    assert _slow_ranks(slowed[0]) == [(step, f"rank {SLOW_RANK}") for step in SLOW_STEPS]
    for rank in range(1, RANKS):
        assert _slow_ranks(slowed[rank]) == []   # rank 0 names them
    # it computed longest and waited least inside the collective at those steps
    own = {rank: {(r["step"], r["name"]): r["value"] for r in rows if r["kind"] == "step_time"
                  and r["micro_step"] is None} for rank, rows in slowed.items()}
    for step in SLOW_STEPS:
        compute = [own[rank][(step, "compute")] for rank in range(RANKS)]
        wait = [own[rank][(step, "reduce")] for rank in range(RANKS)]
        assert int(np.argmax(compute)) == SLOW_RANK and int(np.argmin(wait)) == SLOW_RANK
        assert compute[SLOW_RANK] >= SLEEP
        assert min(wait[r] for r in range(RANKS) if r != SLOW_RANK) >= SLEEP * 0.8


def test_a_balanced_run_names_no_rank(tmp_path_factory):
    runs = _run(tmp_path_factory.mktemp("speed_balanced"), -1, (), 4)
    assert _slow_ranks(runs[0]) == []
    assert any(r["kind"] == "across_ranks" and r["name"] == "step_time/compute/max" for r in runs[0])


def test_rank_0s_cross_rank_figures_equal_numpy_over_the_ranks_own_records(slowed):
    _assert_spread_is_numpys(slowed, STEPS)


@pytest.mark.parametrize("axis", ["tp", "pp", "ep"])
def test_under_model_parallelism_the_spread_covers_every_rank_of_the_job(tmp_path_factory, axis):
    """TP=2 x DP=2 (Megatron's order: ranks 0, 1 are replica 0's tensor-parallel pair), and PP=2 x DP=2
    (ranks 0, 1 stage 0): the rows ride in the data-parallel all-reduce and then the model-parallel sums, so
    rank 0's figures are over all four ranks, its model-parallel peers included, and the extremes' ranks
    are world ranks. EP=2 inside DP=4: the expert-parallel groups lie inside the data-parallel one, whose
    all-reduce already holds every row (a second sum over them would double each row)."""
    runs = _run(tmp_path_factory.mktemp(f"speed_{axis}"), 3, (2,), 4, layout=(axis,))
    _assert_spread_is_numpys(runs, 4)
    assert _slow_ranks(runs[0]) == [(2, "rank 3")]   # not in rank 0's data-parallel group
    assert [r for r in runs[1] + runs[2] + runs[3] if r["kind"] == "across_ranks"] == []


def _assert_spread_is_numpys(runs, steps):
    slowed = runs
    own = defaultdict(dict)
    for rank, rows in slowed.items():
        for r in rows:
            if r["kind"] in ("step_time", "throughput") and r["micro_step"] is None:
                own[(r["step"], f"{r['kind']}/{r['name']}")][rank] = r["value"]
    got = {(r["step"], r["name"]): r["value"] for r in slowed[0] if r["kind"] == "across_ranks"}
    columns = {name for _, name in own}
    assert {"step_time/step", "step_time/data", "step_time/reduce", "throughput/samples_per_second"} <= columns
    checked = 0
    for (step, column), by_rank in own.items():
        # this step's computing time rides in this step's collective; the rest in the next step's
        if column != "step_time/compute" and step == steps:
            assert (step, f"{column}/mean") not in got
            continue
        values = np.array([by_rank[rank] for rank in range(RANKS)], np.float32).astype(np.float64)
        expected = (values.min(), values.mean(), values.max(), values.argmin(), values.argmax())
        for statistic, value in zip(STATISTICS, expected):
            assert got[(step, f"{column}/{statistic}")] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, column)
            checked += 1
    assert checked >= 5 * 12 * (steps - 1)
