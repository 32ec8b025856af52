"""`moe_dropped_tokens` under data parallelism, on two real msrun workers: the step's dropped routing slots
of a capacity-limited router, summed over the ranks as the tokens per expert are, against numpy over the
unsharded global batch (each rank's micro-batches, the capacity rule applied per router call)."""
import numpy as np
import pytest

from tests.support.jsonl import read_jsonl
from tests.support.moe_drops_worker import (CAPACITY, EXPERTS, K, LAYERS, LOCAL_BATCH, RANKS, STEPS, global_batches,
                              router_weights)
from tests.support.msrun_launch import run_workers


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_drops")
    result, logs = run_workers("moe_drops_worker.py", [root / "out"], root, RANKS)
    assert result.returncode == 0, result.stdout[-2000:] + "".join(log[-2000:] for log in logs.values())
    for rank in range(RANKS):
        assert f"moe_drops_worker rank {rank}: ok" in logs[rank], logs[rank][-2000:]
    return {rank: read_jsonl(root / "out" / f"rank_{rank}" / "metrics.jsonl") for rank in range(RANKS)}


def numpy_routing():
    """{(step, layer name, rank, micro_step): (kept per expert, dropped)} from the routers' weights."""
    out = {}
    for step, batch in enumerate(global_batches(), start=1):
        for layer, (weight, bias) in enumerate(router_weights()):
            for rank in range(RANKS):
                for k in range(K):
                    start = (rank * K + k) * LOCAL_BATCH
                    tokens = batch[start:start + LOCAL_BATCH].reshape(-1, weight.shape[1])
                    chosen = np.argmax(tokens @ weight.T + bias, axis=1)
                    kept = np.minimum(np.bincount(chosen, minlength=EXPERTS), CAPACITY)
                    out[(step, f"decoder.layers.{layer}", rank, k)] = (kept, len(chosen) - int(kept.sum()))
    return out


def values(rows, kind):
    return {(r["step"], r["micro_step"], r["name"]): r["value"] for r in rows if r["kind"] == kind}


def test_dropped_tokens_are_the_sum_over_data_parallel(run):
    routing = numpy_routing()
    for rank in range(RANKS):
        dropped = values(run[rank], "moe_dropped_tokens")
        assert len(dropped) == STEPS * LAYERS
        for (step, _, layer), value in dropped.items():
            want = sum(routing[(step, layer, r, k)][1] for r in range(RANKS) for k in range(K))
            assert value == want, (rank, step, layer)
    per_rank = [sum(routing[(1, "decoder.layers.0", r, k)][1] for k in range(K)) for r in range(RANKS)]
    assert min(per_rank) > 0   # each rank dropped some: a rank's own count would differ from the sum


def test_kept_tokens_per_micro_step_are_the_rank_s_own_and_the_step_total_the_sum(run):
    routing = numpy_routing()
    for rank in range(RANKS):
        micro = values(run[rank], "tokens_per_expert")
        assert {key: value for key, value in micro.items()} == \
            {(step, k, layer): routing[(step, layer, rank, k)][0].tolist()
             for step in range(1, STEPS + 1) for layer in [f"decoder.layers.{i}" for i in range(LAYERS)]
             for k in range(K)}
        for (step, _, layer), total in values(run[rank], "tokens_per_expert_step").items():
            want = sum(routing[(step, layer, r, k)][0] for r in range(RANKS) for k in range(K))
            assert total == want.tolist()
