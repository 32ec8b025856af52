"""Model parallelism on real msrun workers over mccl (4 workers): the hand-sharded models of
tests/parallel_model.py trained by tests/parallel_worker.py under a mindmon layout, every number in the
ranks' files checked against a single-process numpy float64 computation of the UNSHARDED model
(tests/parallel_reference.py, gradients by central differences). One launch per layout.
"""
import json

import numpy as np
import pytest

import parallel_reference as ref
import parallel_worker as worker
from conftest import read_jsonl
from msrun_launch import run_workers
from mindmon.parallel.layout import megatron_coordinates

RANKS = 4
RTOL, ATOL = 2e-5, 2e-6   # float32 training against float64


def _launch(mode, tmp_path_factory):
    out = tmp_path_factory.mktemp(mode)
    result, logs = run_workers("parallel_worker.py", [mode, out / "run"], out, ranks=RANKS)
    assert result.returncode == 0, result.stdout[-2000:] + "".join(log[-3000:] for log in logs.values())
    records = {r: read_jsonl(out / "run" / f"rank_{r}" / "metrics.jsonl") for r in range(RANKS)}
    params = {r: dict(np.load(out / "run" / f"params_rank{r}.npz")) for r in range(RANKS)}
    return out / "run", records, params, logs


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    history = ref.train(ref.tp_forward, ref.tp_parameters(), worker.data("tp"), 2, worker.K, worker.LR,
                        worker.MAX_NORM["tp"])
    return (*_launch("tp", tmp_path_factory), history)


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    history = ref.train(ref.pipe_forward, ref.pipe_parameters(), worker.data("pp"), 2, worker.K, worker.LR,
                        worker.MAX_NORM["pp"])
    return (*_launch("pp", tmp_path_factory), history)


def _values(records, kind):
    return {(r["step"], r["micro_step"], r["name"]): r["value"] for r in records if r["kind"] == kind}


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def _coordinates(rank, tp, pp):
    return megatron_coordinates(rank, RANKS, tp, pp)


def test_the_reference_clips_one_step_of_two(tp_run, pp_run):
    """Both layouts' thresholds sit between their two steps' global norms, so clipping is exercised."""
    assert [s["clipped"] for s in tp_run[-1]] == [True, False]
    assert [s["clipped"] for s in pp_run[-1]] == [False, True]


def test_tp_losses_on_every_rank(tp_run):
    _, records, _, _, history = tp_run
    for rank in range(RANKS):
        replica = _coordinates(rank, 2, 1)["dp"]
        local = _values(records[rank], "local_loss")
        assert sorted(local) == [(s, k, "loss") for s in (1, 2) for k in range(worker.K)]
        for (step, k, _), value in local.items():
            _close(value, history[step - 1]["losses"][replica][k])
        for kind in ("device_loss", "loss"):
            _close([_values(records[rank], kind)[(s, None, "loss")] for s in (1, 2)],
                   [h["device_loss"] for h in history])


def _model_name(name):
    return name.replace(".", "_")   # the test block's attribute names (what parameter_names gives)


def test_tp_full_parameter_norms_written_once(tp_run):
    """local_norm (increments of |G_k|), micro_norm (|g_k|), device_norm (|dp mean|) of every FULL parameter,
    on the first tensor-parallel rank of each replica only."""
    _, records, _, _, history = tp_run
    names = list(ref.tp_parameters())
    for rank in range(RANKS):
        coordinates = _coordinates(rank, 2, 1)
        local, micro, device = (_values(records[rank], kind) for kind in ("local_norm", "micro_norm", "device_norm"))
        if coordinates["tp"] == 1:
            assert not local and not micro and not device
            continue
        replica = coordinates["dp"]
        assert len(device) == 2 * len(names) and len(local) == len(micro) == 2 * worker.K * len(names)
        for step, h in enumerate(history, start=1):
            for name in names:
                _close(device[(step, None, _model_name(name))], h["device"][name])
                previous = 0.0
                for k in range(worker.K):
                    accumulated = h["norms"][replica][k][name]
                    _close(local[(step, k, _model_name(name))], accumulated - previous)
                    _close(micro[(step, k, _model_name(name))], h["micro"][replica][k][name])
                    previous = accumulated


def test_tp_global_norm_clipping_and_update(tp_run):
    """grad_norm on every rank is the unsharded model's global norm; the clipped update leaves every shard
    equal to the reference's parameters after two steps."""
    _, records, params, _, history = tp_run
    for rank in range(RANKS):
        grad_norm = _values(records[rank], "grad_norm")
        _close([grad_norm[(s, None, "global")] for s in (1, 2)], [h["grad_norm"] for h in history])
        assert _values(records[rank], "max_norm")[(1, None, "global")] == worker.MAX_NORM["tp"]
        index = _coordinates(rank, 2, 1)["tp"]
        for name, full in history[-1]["params"].items():
            _close(params[rank][name], ref.shard(full, ref.TP_SPLIT.get(name), index, 2))


def test_tp_max_attention_logit_per_head_in_head_order(tp_run):
    _, records, _, _, history = tp_run
    for rank in range(RANKS):
        per_head = _values(records[rank], "max_attention_logit")
        for step, h in enumerate(history, start=1):
            assert len(per_head[(step, None, "block.attn")]) == ref.HEADS
            _close(per_head[(step, None, "block.attn")], h["max_logits"])
            _close(_values(records[rank], "max_attention_logit_max")[(step, None, "all")], h["max_logits"].max())


def test_tp_coordinates_in_every_line_and_layout_file(tp_run):
    run, records, _, _, _ = tp_run
    for rank in range(RANKS):
        want = _coordinates(rank, 2, 1)
        assert all({axis: r[axis] for axis in want} == want for r in records[rank])
        layout = json.loads((run / f"rank_{rank}" / "layout.json").read_text())
        assert layout["coordinates"] == want and layout["rank"] == rank
        assert layout["sizes"] == {"dp": 2, "tp": 2, "pp": 1, "ep": 1, "cp": 1}
        assert {n: (s["axes"], s["dim"]) for n, s in layout["sharded"].items()} == {
            n: (["tp"], dim) for n, dim in ref.TP_SPLIT.items()}


def test_tp_old_readers_keep_working(tp_run):
    from mindmon.formats.jsonl import read_records

    run, records, _, _, _ = tp_run
    decoded = read_records(str(run / "rank_0" / "metrics.jsonl"))
    assert [(r.step, r.kind, r.name, r.value) for r in decoded] == [
        (r["step"], r["kind"], r["name"], r["value"]) for r in records[0]]


def test_layouts_that_do_not_add_up_are_refused_on_every_rank(tp_run, pp_run):
    for run in (tp_run, pp_run):
        logs = run[3]
        for rank in range(RANKS):
            assert ("refused world: layout: dp=1 x tp=%s x pp=%s x cp=1 = 2 ranks, but the job has 4; allowed: "
                    "group sizes whose product is the world size") % (("2", "1") if run is tp_run else ("1", "2")) \
                in logs[rank]
            assert ("refused unknown: layout.sharded['no.such.weight']: names no parameter of this rank; allowed: "
                    "the names of the optimizer's parameters, such as odd.weight") in logs[rank]
            assert ("refused group: layout.tp: got 'no-such-group', a communication group that does not exist (or "
                    "does not hold this rank)") in logs[rank]
    for rank in range(RANKS):
        assert ("refused shape: layout.sharded['odd.weight']: its shards differ in shape between the ranks of the "
                "tp group ((2, 3), (3, 3)); allowed: shards of one shape on every rank") in tp_run[3][rank]


def test_pp_losses_come_from_the_last_stage_on_every_rank(pp_run):
    _, records, _, _, history = pp_run
    for rank in range(RANKS):
        replica = _coordinates(rank, 1, 2)["dp"]
        local = _values(records[rank], "local_loss")
        assert len(local) == 2 * worker.K
        for (step, k, _), value in local.items():
            _close(value, history[step - 1]["losses"][replica][k])
        for kind in ("device_loss", "loss"):
            _close([_values(records[rank], kind)[(s, None, "loss")] for s in (1, 2)],
                   [h["device_loss"] for h in history])


def test_pp_loss_components_come_from_the_last_stage(pp_run):
    """Only the last stage computes the loss: its ranks write its component per micro-batch and its mean
    over the micro-batches of both data-parallel replicas; the first stage's ranks write none, and say nothing."""
    _, records, _, logs, history = pp_run
    for rank in range(RANKS):
        coordinates = _coordinates(rank, 1, 2)
        micro, step = _values(records[rank], "loss_component"), _values(records[rank], "loss_component_step")
        assert "LossComponentsMonitor failed" not in logs[rank]
        if coordinates["pp"] == 0:
            assert micro == {} and step == {}
            continue
        assert len(micro) == 2 * worker.K
        for (s, k, name), value in micro.items():
            assert name == "mse"
            _close(value, history[s - 1]["losses"][coordinates["dp"]][k])
        _close([step[(s, None, "mse")] for s in (1, 2)], [h["device_loss"] for h in history])


def test_pp_norms_per_stage_and_global_over_both_stages(pp_run):
    _, records, params, _, history = pp_run
    for rank in range(RANKS):
        stage, replica = _coordinates(rank, 1, 2)["pp"], _coordinates(rank, 1, 2)["dp"]
        device, local = _values(records[rank], "device_norm"), _values(records[rank], "local_norm")
        grad_norm = _values(records[rank], "grad_norm")
        for step, h in enumerate(history, start=1):
            _close(grad_norm[(step, None, "global")], h["grad_norm"])
            for part in ("weight", "bias"):
                _close(device[(step, None, part)], h["device"][f"stage{stage}.{part}"])
                _close(local[(step, 0, part)], h["norms"][replica][0][f"stage{stage}.{part}"])
        for name, value in params[rank].items():
            assert ref.PIPE_STAGE[name] == stage
            _close(value, history[-1]["params"][name])


def _ep_records(tp_run):
    run = tp_run[0]
    return {r: read_jsonl(run.parent / "run-ep" / f"rank_{r}" / "metrics.jsonl") for r in range(RANKS)}


def test_ep_tokens_per_expert_cover_every_expert(tp_run):
    """EP=2 within DP=4: each rank counts its 2 experts' tokens; every rank writes all 4 experts' counts,
    those of the tokens of its expert-parallel group (ranks 0, 1 and ranks 2, 3)."""
    records, weight = _ep_records(tp_run), ref.router_weight()
    for rank in range(RANKS):
        mates = (0, 1) if rank < 2 else (2, 3)
        per_micro_step = _values(records[rank], "tokens_per_expert")
        step_totals = _values(records[rank], "tokens_per_expert_step")
        for step in range(1, worker.STEPS + 1):
            tokens = {m: ref.router_tokens(m, step, worker.K * worker.ROWS) for m in mates}
            total = np.zeros(ref.EXPERTS, np.int64)
            for k in range(worker.K):
                rows = slice(k * worker.ROWS, (k + 1) * worker.ROWS)
                want = sum(ref.routed(weight, tokens[m][rows]) for m in mates)
                assert per_micro_step[(step, k, "decoder.layers.0")] == list(want)
                total += want
            assert step_totals[(step, None, "decoder.layers.0")] == list(total)


def test_ep_replicated_router_counted_once_in_the_global_norm(tp_run):
    records, weight = _ep_records(tp_run), ref.router_weight()
    for step in range(1, worker.STEPS + 1):
        mean = np.zeros_like(weight)
        for rank in range(RANKS):
            tokens = ref.router_tokens(rank, step, worker.K * worker.ROWS)
            for k in range(worker.K):
                mean += ref.router_gradient(weight, tokens[k * worker.ROWS:(k + 1) * worker.ROWS]) / (worker.K * RANKS)
        for rank in range(RANKS):
            _close(_values(records[rank], "grad_norm")[(step, None, "global")], np.linalg.norm(mean))
