"""Model parallelism on real msrun workers over mccl (4 workers): the hand-sharded models of
tests/support/parallel_model.py trained by tests/support/parallel_worker.py under a mindmon layout, every number in the
ranks' files checked against a single-process numpy float64 computation of the UNSHARDED model
(tests/support/parallel_reference.py, gradients by central differences). One launch per layout.
"""
import json
import re

import numpy as np
import pytest

from tests.support import parallel_reference as ref
from tests.support import parallel_worker as worker
from tests.support.jsonl import read_jsonl
from tests.support.msrun_launch import run_workers
from mindmon.parallel.layout import megatron_coordinates

pytestmark = pytest.mark.serial   # 4 msrun ranks

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


# --- msprobe's TrainerMon on the same launches (tests/support/parallel_trainer_mon.py) ---------------------------

NDIGITS_ATOL = 2e-6   # the CSV rounds to 6 decimal places


def _msprobe_rows(run, rank, prefix):
    """{(vpp_stage, name, step, micro_step or None): {op: value}} of rank's CSV files `prefix_*.csv`, read
    with the csv module (not mindmon's reader); None when the rank wrote none."""
    import csv

    folders = list((run.parent / "run-msprobe").glob(f"*-rank{rank}-*"))
    assert len(folders) == 1, folders
    files = sorted(path for path in folders[0].glob(f"{prefix}_*.csv")
                   if re.fullmatch(rf"{prefix}_\d+-\d+\.csv", path.name))   # not actv_grad_* for actv
    if not files:
        return None
    rows = {}
    for path in files:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                micro = int(row["micro_step"]) if row.get("micro_step") else None
                key = (int(row["vpp_stage"]), row["name"], int(row["step"]), micro)
                assert key not in rows, key
                rows[key] = {op: float(row[op]) for op in ("norm", "mean", "max") if op in row}
    return rows


def _statistics(array):
    return {"norm": float(np.linalg.norm(array)), "mean": float(array.mean()), "max": float(array.max())}


def _close_rows(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        for op, value in want[key].items():
            np.testing.assert_allclose(got[key][op], value, rtol=1e-5, atol=NDIGITS_ATOL, err_msg=str((key, op)))


@pytest.fixture(scope="module")
def vpp_history():
    return ref.train(ref.vpp_forward, ref.vpp_parameters(), worker.vpp_data(), 2, worker.K, worker.LR, 0.0)


# The targets {"0:layers.0": {}, "layers.0.weight": {}}: chunk 0's weight and bias, chunk 1's weight only.
VPP_SELECTED = [(0, "weight"), (0, "bias"), (1, "weight")]


def _layer(chunk, stage):
    return chunk * ref.PP + stage


def test_vpp_gradient_and_weight_rows_per_chunk(pp_run, vpp_history):
    """set_monitor([chunk0, chunk1]): each row's vpp_stage is its chunk, its name the chunk's own name
    (layers.0.*), its values those of layer chunk x PP + stage of the unsharded 4-layer model. grad_reduced
    (the dp mean) only on the first rank of each data-parallel group; grad_unreduced (this replica's micro-batch
    gradients summed) on every rank; param_origin / param_updated before and after each step."""
    run = pp_run[0]
    for rank in range(RANKS):
        stage, replica = _coordinates(rank, 1, 2)["pp"], _coordinates(rank, 1, 2)["dp"]
        want = {prefix: {} for prefix in ("grad_reduced", "grad_unreduced", "param_origin", "param_updated")}
        for step, h in enumerate(vpp_history):
            for chunk, part in VPP_SELECTED:
                name = f"layer{_layer(chunk, stage)}.{part}"
                key = (chunk, f"layers.0.{part}", step, None)
                want["grad_reduced"][key] = _statistics(h["mean_grad"][name])
                want["grad_unreduced"][key] = _statistics(worker.K * h["accumulated"][replica][name])
                want["param_origin"][key] = _statistics(h["params_before"][name])
                want["param_updated"][key] = _statistics(h["params"][name])
        for prefix, rows in want.items():
            got = _msprobe_rows(run, rank, prefix)
            if prefix == "grad_reduced" and replica != 0:
                assert got is None   # the data-parallel copies: written once per dp group
                continue
            _close_rows(got, rows)


def test_vpp_activation_rows_per_chunk_and_micro_step(pp_run, vpp_history):
    """all_xy: each chunk's root (`.input`, `.output`) and `layers.0` per micro-batch, under its chunk."""
    run, data = pp_run[0], worker.vpp_data()
    for rank in range(RANKS):
        stage, replica = _coordinates(rank, 1, 2)["pp"], _coordinates(rank, 1, 2)["dp"]
        want = {}
        for step, (h, (x, _)) in enumerate(zip(vpp_history, data)):
            for micro in range(worker.K):
                start = (replica * worker.K + micro) * worker.ROWS
                xb = x[start:start + worker.ROWS]
                outputs = ref.vpp_activations(h["params_before"], xb)
                for chunk in range(ref.VPP_CHUNKS):
                    layer = _layer(chunk, stage)
                    values = {"input": xb if layer == 0 else outputs[layer - 1], "output": outputs[layer]}
                    for cell in ("layers.0", ""):
                        for point, value in values.items():
                            want[(chunk, f"{cell}.{point}", step, micro)] = _statistics(value)
        _close_rows(_msprobe_rows(run, rank, "actv"), want)


PHASES = {"actv": 0, "actv_grad": 1, "grad_unreduced": 1, "grad_reduced": 1, "param_origin": 2, "param_updated": 2}


def _msprobe_order(entry):
    """msprobe's order of anomalies (its GradAnomalyData): step, micro-step, forward < backward < optimizer,
    then in the forward vpp_stage and pp_stage ascending, elsewhere descending, then call_id."""
    phase = PHASES[entry["kind"]]
    sign = 1 if phase == 0 else -1
    micro = float("inf") if entry["micro_step"] is None else entry["micro_step"]
    return (entry["step"], micro, phase, sign * entry["vpp_stage"], sign * entry["pp_stage"], entry["call_id"],
            entry["rank"])


def test_vpp_anomalies_carry_stages_and_are_ordered_across_stages(pp_run):
    """process_group gives pp_stage (and group_mates, the pipeline group's ranks); the chunk gives vpp_stage;
    `mindmon anomalies` orders every rank's anomalies of step 1 as msprobe's analyser does: a micro-batch's
    forward through chunk 0 of stages 0, 1, then chunk 1 of stages 0, 1; its backward in reverse."""
    import subprocess
    import sys

    root = pp_run[0].parent / "run-msprobe"
    dumps = {}
    for rank in range(RANKS):
        entries = json.loads((root / "anomaly_detected" / f"rank{rank}" / "anomaly.json").read_text())
        stage = _coordinates(rank, 1, 2)["pp"]
        mates = [r for r in range(RANKS) if _coordinates(r, 1, 2)["dp"] == _coordinates(rank, 1, 2)["dp"]]
        for entry in entries.values():
            chunk = int(entry["name"].split(":")[0])
            assert (entry["pp_stage"], entry["vpp_stage"], entry["group_mates"]) == (stage, chunk, mates)
        dumps.update({(rank, key): entry for key, entry in entries.items()})
    out = root / "analysed.json"
    result = subprocess.run([sys.executable, "-m", "mindmon", "anomalies", "-d", str(root), "-o", str(out),
                             "-k", "100000", "-s", "1"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    analysed = list(json.loads(out.read_text()).values())
    step1 = [entry for entry in dumps.values() if entry["step"] == 1]
    assert len(analysed) == len(step1) > 0
    assert [_msprobe_order(e) for e in analysed] == sorted(_msprobe_order(e) for e in step1)
    stages = {}
    for entry in analysed:
        if entry["micro_step"] == 0 and entry["kind"] in ("actv", "actv_grad"):
            order = stages.setdefault(entry["kind"], [])
            where = (entry["vpp_stage"], entry["pp_stage"])
            if not order or order[-1] != where:
                order.append(where)
    assert stages == {"actv": [(0, 0), (0, 1), (1, 0), (1, 1)], "actv_grad": [(1, 1), (1, 0), (0, 1), (0, 0)]}


def test_tp_group_dedup_of_grad_reduced_rows(tp_run):
    """set_monitor(net, ..., tp_group, dp_group) on TP=2 x DP=2: grad_reduced rows on the first rank of each
    data-parallel group only; there, the replicated parameters (layer norms, row-parallel biases) on the first
    tensor-parallel rank only and each sharded one on both, with the norm of this rank's shard of the
    unsharded model's dp-mean gradient."""
    run, history = tp_run[0], tp_run[-1]
    for rank in range(RANKS):
        coordinates = _coordinates(rank, 2, 1)
        got = _msprobe_rows(run, rank, "grad_reduced")
        if coordinates["dp"] != 0:
            assert got is None
            continue
        want = {}
        for name, gradient in history[0]["mean_grad"].items():
            dim = ref.TP_SPLIT.get(name)
            if dim is None and coordinates["tp"] != 0:
                continue
            shard = ref.shard(gradient, dim, coordinates["tp"], 2)
            want[(0, _model_name(name), 0, None)] = {"norm": float(np.linalg.norm(shard))}
        assert len(want) == (12 if coordinates["tp"] == 0 else 6)
        _close_rows(got, want)


def _merged(run, tmp_path):
    import csv

    from mindmon.analysis.merge import merge

    path, _ = merge(str(run), str(tmp_path / "merged.csv"), progress=None)
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_merge_of_the_tp_run_shows_full_parameters(tp_run, tmp_path):
    """Over TP=2 x DP=2: each parameter's norm rows pool the replicas' first tensor-parallel ranks (0 and 2),
    and every one of them is the FULL parameter's value; no pp/ep columns (every rank is stage 0, ep 0)."""
    run, history = tp_run[0], tp_run[-1]
    rows = _merged(run, tmp_path)
    assert "pp" not in rows[0]
    device = {(int(r["step"]), r["name"]): r for r in rows if r["kind"] == "device_norm"}
    assert len(device) == 2 * len(ref.tp_parameters())
    for step, h in enumerate(history, start=1):
        for name in ref.tp_parameters():
            row = device[(step, _model_name(name))]
            assert row["ranks"] == "2"
            _close([float(row["min"]), float(row["max"])], [h["device"][name]] * 2)


def test_merge_of_the_pp_run_keeps_the_stages_apart(pp_run, tmp_path):
    """Both stages name their parameters `weight` and `bias`: the merged rows key on pp, so each row is one
    stage's parameter (pooled over its two replicas), never a mix of the two stages."""
    run, history = pp_run[0], pp_run[-1]
    rows = _merged(run, tmp_path)
    device = {(int(r["step"]), r["name"], int(r["pp"])): r for r in rows if r["kind"] == "device_norm"}
    assert sorted(device) == sorted((s, part, stage) for s in (1, 2) for part in ("weight", "bias") for stage in (0, 1))
    for (step, part, stage), row in device.items():
        assert row["ranks"] == "2" and row["ep"] == "0"
        _close([float(row["min"]), float(row["max"])], [history[step - 1]["device"][f"stage{stage}.{part}"]] * 2)
    losses = [r for r in rows if r["kind"] == "loss"]
    assert sorted((int(r["step"]), int(r["pp"])) for r in losses) == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_monitor_config_weight_norm_of_the_whole_model(tp_run, pp_run):
    """weight_norm (monitor_config) after each step, on every rank: the norm of every parameter of the
    unsharded model (every shard of every stage once), as one device would compute it."""
    for run in (tp_run, pp_run):
        records, history = run[1], run[-1]
        for rank in range(RANKS):
            got = _values(records[rank], "weight_norm")
            want = [np.sqrt(sum(np.sum(v ** 2) for v in h["params"].values())) for h in history]
            _close([got[(s, None, "global")] for s in (1, 2)], want)


def test_monitor_config_adam_moment_norms_of_full_parameters(tp_run):
    """adam_m_norm / adam_v_norm after one Adam step from zero moments: (1 - beta1) |g| and (1 - beta2) |g^2|
    of the FULL dp-mean gradient g, written by the first tensor-parallel rank of each replica only."""
    run, history = tp_run[0], tp_run[-1]
    gradient = history[0]["mean_grad"]
    for rank in range(RANKS):
        records = read_jsonl(run.parent / "run-adam" / f"rank_{rank}" / "metrics.jsonl")
        m, v = _values(records, "adam_m_norm"), _values(records, "adam_v_norm")
        if _coordinates(rank, 2, 1)["tp"] == 1:
            assert not m and not v
            continue
        assert len(m) == len(v) == len(gradient)
        for name, g in gradient.items():
            _close(m[(1, None, name)], 0.1 * np.linalg.norm(g))
            _close(v[(1, None, name)], 0.001 * np.linalg.norm(g ** 2))


def test_dask_merge_of_the_pp_run_equals_the_duckdb_merge(pp_run, tmp_path):
    """The PP run compacted to Parquet (its coordinates read from the JSONL): the Dask merge on a LocalCluster
    of two worker processes writes the DuckDB merge's table, pp and ep columns included, byte for byte."""
    import filecmp
    import shutil

    import distributed

    from mindmon.analysis.compact import compact_run
    from mindmon.analysis.dask_merge import merge_on_dask
    from mindmon.analysis.merge import merge

    run = tmp_path / "run"
    shutil.copytree(pp_run[0], run)
    compact_run(str(run), progress=None)
    want, _ = merge(str(run), str(tmp_path / "duckdb.csv"), source="columnar", progress=None)
    assert open(want).readline().strip().endswith(",pp,ep")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        got, _ = merge_on_dask(str(run), str(tmp_path / "dask.csv"), scheduler=cluster.scheduler_address)
    assert filecmp.cmp(want, got, shallow=False)
