"""Two real msrun ranks: grad_unreduced is each rank's own summed gradient, grad_reduced the data-parallel
mean the optimizer gets, written by the first rank of dp_group only."""
import glob
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np

from tests.support.msprobe_reference import NAMES, adam_weight_decay, batches, gradients, initial_weights, statistic
from mindmon.formats.msprobe_csv import read_csv
from tests.support import HERE, REPO

RANKS, STEPS = 2, 2


def reference():
    """{(prefix, rank, step, name): array} for the worker's loop, in float64."""
    w = {n: a.astype(np.float64) for n, a in initial_weights().items()}
    m = {n: np.zeros_like(a) for n, a in w.items()}
    v = {n: np.zeros_like(a) for n, a in w.items()}
    rows = {}
    for step in range(STEPS):
        per_rank = []
        for rank in range(RANKS):
            parts = [gradients(w, x * (1 + rank), y) for x, y in batches()[step]]
            per_rank.append({n: sum(p[n] for p in parts) for n in NAMES})
        for n in NAMES:
            mean = sum(g[n] for g in per_rank) / RANKS
            for rank in range(RANKS):
                rows[("grad_unreduced", rank, step, n)] = per_rank[rank][n]
                rows[("param_origin", rank, step, n)] = w[n]
            rows[("grad_reduced", 0, step, n)] = mean
            w[n], m[n], v[n] = adam_weight_decay(w[n], mean, m[n], v[n], step + 1)
    return rows


def test_two_ranks(tmp_path):
    config = tmp_path / "monitor_config.json"
    config.write_text(json.dumps({"wg_distribution": True, "param_distribution": True,
                                  "ops": ["min", "max", "mean", "norm"], "ndigits": 12}))
    bin_dir = os.path.dirname(sys.executable)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               MONITOR_OUTPUT_DIR=str(tmp_path / "out"),
               PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]))
    msrun = shutil.which("msrun", path=bin_dir) or "msrun"
    result = subprocess.run([msrun, f"--worker_num={RANKS}", f"--local_worker_num={RANKS}", f"--master_port={port}",
                             f"--log_dir={tmp_path / 'logs'}", "--join=True",
                             os.path.join(HERE, "msprobe_dp_worker.py"),
                             str(config)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    logs = "".join(p.read_text()[-2000:] for p in (tmp_path / "logs").glob("worker_*.log"))
    assert result.returncode == 0, result.stdout[-2000:] + logs
    expected = reference()
    seen = set()
    for rank in range(RANKS):
        (folder,) = glob.glob(str(tmp_path / "out" / f"*-rank{rank}-*"))
        files = sorted(os.listdir(folder))
        assert any(f.startswith("grad_reduced") for f in files) == (rank == 0), files  # dp_group: first rank only
        for path in glob.glob(os.path.join(folder, "*.csv")):
            for record in read_csv(path):
                key = (record.kind, rank if record.kind != "grad_reduced" else 0, record.step - 1, record.name)
                if record.kind == "param_updated":
                    continue
                seen.add(key)
                for op, value in zip(record.ops, record.value):
                    want = statistic(expected[key], op)
                    scale = np.abs(expected[key]).max() if op == "mean" else abs(want)
                    assert abs(value - want) <= 1e-5 * scale + 1e-12, (key, op, value, want)
    assert seen == set(expected)
    # The ranks' gradients differ before the reduction, so the check above tells them apart.
    rank0, rank1 = (expected[("grad_unreduced", rank, 0, "fc1.weight")] for rank in range(RANKS))
    assert not np.allclose(rank0, rank1)
