"""Activations with two real msrun workers (data parallel over mccl on CPU): each rank writes its own
actv / actv_grad files in its own run folder, and every statistic of every row is that rank's, checked
against a float64 numpy recomputation from that rank's inputs and the data-parallel weights of each step."""
import glob
import json
import os

import numpy as np

from tests.support.activations_reference import activation_rows
from tests.support.msprobe_reference import K, NAMES, statistic
from tests.support.msrun_launch import run_workers
from tests.msprobe.test_msprobe_data_parallel import reference as data_parallel_reference
from mindmon.formats.msprobe_csv import read_csv

RANKS, STEPS = 2, 2
OPS = ["min", "max", "mean", "norm", "zeros", "nans"]
RTOL = 1e-5


def rank_rows(root, rank):
    """{(prefix, step, micro_step, name): record} of one rank's activation files, each key once."""
    folders = glob.glob(str(root / f"*-rank{rank}-*"))
    assert len(folders) == 1, folders
    files = sorted(os.listdir(folders[0]))
    # One file per prefix and step (step_count_per_record 1), as on a single process.
    assert [f for f in files if f.startswith("actv")] == [f"{prefix}_{s}-{s}.csv" for prefix in ("actv", "actv_grad")
                                                           for s in range(STEPS)], files
    rows = {}
    for path in glob.glob(os.path.join(folders[0], "actv*.csv")):
        for record in read_csv(path):
            key = (record.kind, record.step - 1, record.micro_step, record.name)
            assert key not in rows, f"rank {rank}: {key} written twice"
            rows[key] = record
    return rows


def test_each_rank_writes_its_own_activations(tmp_path):
    config = tmp_path / "monitor_config.json"
    config.write_text(json.dumps({"xy_distribution": True, "all_xy": True, "ops": OPS, "ndigits": 12}))
    result, logs = run_workers("msprobe_dp_worker.py", [config, "relu_cell"], tmp_path, RANKS,
                               env={"MONITOR_OUTPUT_DIR": str(tmp_path / "out")})
    assert result.returncode == 0, result.stdout[-2000:] + "".join(log[-2000:] for log in logs.values())
    weights = data_parallel_reference()
    per_rank = {}
    for rank in range(RANKS):
        rows = rank_rows(tmp_path / "out", rank)
        expected = activation_rows(STEPS, lambda step: {n: weights[("param_origin", rank, step, n)] for n in NAMES},
                                   input_scale=1 + rank)
        assert set(rows) == set(expected), sorted(set(rows) ^ set(expected))[:6]
        assert {key[2] for key in rows} == set(range(K))
        for key, record in rows.items():
            want_array = expected[key]
            assert tuple(record.shape) == want_array.shape, key
            for op, value in zip(record.ops, record.value):
                want = statistic(want_array, op)
                scale = np.abs(want_array).max() if op == "mean" else abs(want)
                assert abs(value - want) <= RTOL * scale + 1e-12, (rank, key, op, value, want)
        per_rank[rank] = rows
    # The ranks' inputs differ (x and 2x), so the check above tells their files apart.
    first = [per_rank[r][("actv", 0, 0, "fc1.input")].value for r in range(RANKS)]
    assert not np.allclose(first[0], first[1])
