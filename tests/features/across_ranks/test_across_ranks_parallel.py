"""monitor.across_ranks under tensor parallelism, on four real msrun workers (TP=2 x DP=2 over mccl on CPU,
tests/support/parallel_across_ranks_worker.py): rank 0's min, mean, max and extreme ranks are over the two
data-parallel replicas of each replica's FULL-parameter norms and its losses, checked against numpy over a
float64 computation of the unsharded model per replica (tests/support/parallel_reference.py); no other rank writes
any; pipeline parallelism is refused with one line."""
import numpy as np
import pytest

from tests.support import parallel_reference as ref
from tests.support import parallel_worker as worker
from tests.support.jsonl import read_jsonl
from tests.support.msrun_launch import run_workers

pytestmark = pytest.mark.serial   # 4 msrun ranks

RANKS, REPLICAS = 4, 2
STATISTICS = ("min", "mean", "max", "min_rank", "max_rank")
RTOL, ATOL = 2e-5, 2e-6   # float32 training and float32 sums against float64


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("across_ranks_tp")
    result, logs = run_workers("parallel_across_ranks_worker.py", [root / "out"], root, ranks=RANKS)
    assert result.returncode == 0, result.stdout[-2000:] + "".join(log[-3000:] for log in logs.values())
    records = {rank: read_jsonl(root / "out" / f"rank_{rank}" / "metrics.jsonl") for rank in range(RANKS)}
    history = ref.train(ref.tp_forward, ref.tp_parameters(), worker.data("tp"), REPLICAS, worker.K, worker.LR,
                        worker.MAX_NORM["tp"])
    return records, logs, history


def _model_name(name):
    return name.replace(".", "_")   # the test block's attribute names (what parameter_names gives)


def _expected(history):
    """{(step, micro_step, name): value} of every summary, numpy over the replicas' own values."""
    per_replica = {}   # (step, micro_step, column) -> [replica 0's, replica 1's]
    for step, h in enumerate(history, start=1):
        for d in range(REPLICAS):
            values = {(step, None, "device_loss"): float(np.mean(h["losses"][d]))}
            for k in range(worker.K):
                values[(step, k, "local_loss")] = h["losses"][d][k]
                for name in ref.tp_parameters():
                    values[(step, k, f"micro_norm/{_model_name(name)}")] = h["micro"][d][k][name]
            for name in ref.tp_parameters():
                values[(step, None, f"accumulated_norm/{_model_name(name)}")] = h["norms"][d][worker.K - 1][name]
            for key, value in values.items():
                per_replica.setdefault(key, []).append(value)
    expected = {}
    for (step, micro, column), values in per_replica.items():
        values = np.array(values)
        for statistic, value in zip(STATISTICS, (values.min(), values.mean(), values.max(), values.argmin(),
                                                 values.argmax())):
            expected[(step, micro, f"{column}/{statistic}")] = float(value)
    return expected


def test_rank_0s_summaries_are_numpys_over_the_replicas_full_model_values(run):
    records, _, history = run
    got = {(r["step"], r["micro_step"], r["name"]): r["value"] for r in records[0] if r["kind"] == "across_ranks"}
    expected = _expected(history)
    assert set(got) == set(expected)
    for key, value in expected.items():
        if key[2].endswith("_rank"):
            assert got[key] == value, key
        else:
            np.testing.assert_allclose(got[key], value, rtol=RTOL, atol=ATOL, err_msg=str(key))
    # the replicas differ, so a summary over them is not one rank's value
    spread = [expected[k[:2] + (k[2].rsplit("/", 1)[0] + "/max",)] - v for k, v in expected.items()
              if k[2].endswith("/min")]
    assert min(spread) > 1e-4


def test_no_other_rank_writes_summaries(run):
    records, _, _ = run
    for rank in range(1, RANKS):
        assert not [r for r in records[rank] if r["kind"] == "across_ranks"], rank


def test_pipeline_parallelism_is_refused_with_one_line(run):
    _, logs, _ = run
    for rank in range(RANKS):
        assert ("refused pp: monitor.across_ranks.enabled: true with pp=2 (a replica's parameters or experts "
                "spread over those ranks are not summed by it); allowed: data, tensor and context parallelism"
                ) in logs[rank], logs[rank][-2000:]
