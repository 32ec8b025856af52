"""cc_distribution with two real msrun workers on CPU (mccl): the statistics of what each rank's AllReduce,
AllGather and Broadcast calls took and gave, against numpy on the tensors the ranks sent; cc_codeline
leaving a call site out; cc_log_only logging each call once and stopping cleanly before the second optimizer
step; the collectives restored exactly after close. Single-process: the wrappers' install and removal."""
import glob
import os
import re
import shutil
import socket
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from mindmon.formats.msprobe_csv import read_csv
from tests.support import HERE, REPO

RANKS, STEPS = 2, 2
OPS = ("min", "max", "mean", "norm")
with open(os.path.join(HERE, "cc_worker.py")) as _source:
    WORKER_LINES = {line.split("# ")[-1].strip(): number for number, line in enumerate(_source, 1) if "  # " in line}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("cc")
    bin_dir = os.path.dirname(sys.executable)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]))
    msrun = shutil.which("msrun", path=bin_dir) or "msrun"
    result = subprocess.run([msrun, f"--worker_num={RANKS}", f"--local_worker_num={RANKS}", f"--master_port={port}",
                             f"--log_dir={base / 'logs'}", "--join=True", os.path.join(HERE, "cc_worker.py"),
                             str(base)], env=env, cwd=base, capture_output=True, text=True, timeout=600)
    logs = {r: (base / "logs" / f"worker_{r}.log").read_text() for r in range(RANKS)}
    assert result.returncode == 0, result.stdout[-2000:] + "".join(t[-3000:] for t in logs.values())
    return base, logs


def numpy_stats(array):
    flat = np.asarray(array, np.float64).ravel()
    return [flat.min(), flat.max(), flat.mean(), np.sqrt((flat * flat).sum())]


def expected_rows(base):
    """{(rank, kind, step, api, call): array} from the tensors both ranks sent, in float64."""
    sent = [np.load(base / f"sent_rank{r}.npz") for r in range(RANKS)]
    rows = {}
    for step in range(STEPS):
        grads = [[s[f"{step}_grad{i}"].astype(np.float64) for i in range(2)] for s in sent]
        small = [s[f"{step}_small"].astype(np.float64) for s in sent]
        for rank in range(RANKS):
            for i in range(2):
                rows[(rank, "cc_pre", step, "AllReduce", i)] = grads[rank][i]
                rows[(rank, "cc_post", step, "AllReduce", i)] = grads[0][i] + grads[1][i]
            rows[(rank, "cc_pre", step, "AllGather", 0)] = small[rank]
            rows[(rank, "cc_post", step, "AllGather", 0)] = np.concatenate(small, axis=0)
            rows[(rank, "cc_pre", step, "Broadcast", 0)] = small[rank]
            rows[(rank, "cc_post", step, "Broadcast", 0)] = small[0]   # root rank 0
    return rows


def test_statistics_of_each_rank_against_numpy(run):
    base, _ = run
    expected = expected_rows(base)
    seen = {}
    for rank in range(RANKS):
        (folder,) = glob.glob(str(base / "stats" / f"*-rank{rank}-*"))
        for path in glob.glob(os.path.join(folder, "*.csv")):
            calls = Counter()   # msprobe's CSV names a row `<function>.<role>`; a function's rows in call order
            for record in read_csv(path, rank):
                api, role = re.fullmatch(r"(\w+)\.(input|output)", record.name).groups()
                assert role == ("input" if record.kind == "cc_pre" else "output")
                key = (rank, record.kind, record.step - 1, api, calls[(record.step, api)])
                calls[(record.step, api)] += 1
                seen[key] = path
                assert record.ops == OPS
                want = numpy_stats(expected[key])
                assert record.value == pytest.approx(want, rel=1e-6, abs=1e-9), (key, record.value, want)
    # Every call of `exchange` seen, the AllReduce of sync_metric (not in cc_codeline) never.
    assert set(seen) == set(expected)
    # The two ranks' inputs differ, so the pre/post rows tell a rank's own tensors from the reduced ones.
    assert not np.allclose(expected[(0, "cc_pre", 0, "AllReduce", 0)], expected[(1, "cc_pre", 0, "AllReduce", 0)])


def test_log_once_per_call_and_clean_stop(run):
    base, logs = run
    for rank in range(RANKS):
        log = logs[rank]
        for api in ("AllReduce", "AllGather", "Broadcast"):
            # statistics run: sync_metric's AllReduce is filtered out before logging; log-only run: all calls.
            heads = re.findall(rf"mindmon: collective {api}, input dtype Float32, group mccl_world_group, "
                               rf"called from:\n((?:    \S+\n)+)", log)
            assert heads, (rank, api, log[-3000:])
            assert len(heads) == len(set(heads)), heads   # each distinct stack once
            assert all("cc_worker.py[" in h for h in heads)
        calls = Counter((api, int(line)) for api, line in
                        re.findall(r"collective (\w+), [^\n]*called from:\n    \S+cc_worker\.py\[(\d+)\]", log))
        # Once per run for the calls of `exchange`; sync_metric's only in the log-only run (cc_codeline there
        # leaves it out before anything is logged).
        assert calls == {("AllReduce", WORKER_LINES["taken: cc_codeline line 1"]): 2,
                         ("AllGather", WORKER_LINES["taken: cc_codeline line 2"]): 2,
                         ("Broadcast", WORKER_LINES["taken: cc_codeline line 2"]): 2,
                         ("AllReduce", WORKER_LINES["not in cc_codeline"]): 1}, calls
        assert "patched after close: False" in log
        assert "stopped: code 0 at step 1; patched: False" in log
        assert "training stopped before the second optimizer step" in log
    # log-only: no statistics written.
    assert not glob.glob(str(base / "log_only" / "*" / "cc_*.csv"))


def test_wrappers_installed_and_restored_exactly_in_one_process():
    from mindspore import ops
    from mindspore.communication import comm_func

    from mindmon.config import ConfigError
    from mindmon.core.group import MonitorGroup
    from mindmon.features.collectives.hooks import COMM_FUNCS, PRIMITIVES, CollectivePatch
    from mindmon.features.l2.config import CcConfig

    before = {name: getattr(comm_func, name) for name in COMM_FUNCS}
    patch = CollectivePatch(MonitorGroup(), None, CcConfig(enable=True), lambda: True)
    assert all("__call__" in vars(getattr(ops, name)) for name in PRIMITIVES)
    assert all(getattr(comm_func, name) is not before[name] and getattr(comm_func, name).__wrapped__ is before[name]
               for name in COMM_FUNCS)
    with pytest.raises(ConfigError, match="another TrainerMon already watches the collectives"):
        CollectivePatch(MonitorGroup(), None, CcConfig(enable=True), lambda: True)
    patch.remove()
    assert not any("__call__" in vars(getattr(ops, name)) for name in PRIMITIVES)
    CollectivePatch(MonitorGroup(), None, CcConfig(enable=True), lambda: True).remove()   # free again
    assert all(getattr(comm_func, name) is before[name] for name in COMM_FUNCS)


def test_cc_log_only_uncaught_ends_the_script_with_status_0(tmp_path):
    """A script that does not catch the stop: exit status 0, no traceback, the reason in the log."""
    config = tmp_path / "config.json"
    config.write_text('{"cc_distribution": {"enable": true, "cc_log_only": true}}')
    script = tmp_path / "train.py"
    script.write_text(
        "import logging, numpy as np, mindspore as ms\n"
        "from mindspore import nn, value_and_grad\n"
        "from mindmon.msprobe import TrainerMon\n"
        "logging.basicConfig()\n"
        "model = nn.Dense(3, 2)\n"
        "optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)\n"
        f"TrainerMon({str(config)!r}, params_have_main_grad=False).set_monitor(model, 1, optimizer)\n"
        "grad_fn = value_and_grad(lambda x: model(x).sum(), None, optimizer.parameters)\n"
        "for step in range(5):\n"
        "    print('step', step, flush=True)\n"
        "    optimizer(grad_fn(ms.Tensor(np.ones((2, 3), np.float32)))[1])\n"
        "print('not reached')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               MONITOR_OUTPUT_DIR=str(tmp_path / "out"))
    result = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["step", "0", "step", "1"]
    assert "training stopped before the second optimizer step" in result.stderr
    assert "Traceback" not in result.stderr
