"""cc_distribution through kj600's hook_modules, on two real msrun workers on CPU (mccl): AllReduce wrapped
while training and restored after close; the statistics of what each rank's AllReduce took and gave, read
back from kj600's TensorBoard with TensorBoard's reader, against numpy on the gradients the ranks sent;
cc_log_only without an optimizer logging the calls and stopping cleanly at the second step."""
import glob
import re

import numpy as np
import pytest

from msrun_launch import run_workers

RANKS, STEPS = 2, 2
OPS = ("min", "max", "mean", "norm")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("kj600_cc")
    result, logs = run_workers("kj600_cc_worker.py", [base], base, RANKS)
    assert result.returncode == 0, result.stdout[-2000:] + "".join(t[-3000:] for t in logs.values())
    return base, logs


def scalars(event_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(event_dir)
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def numpy_stats(array):
    flat = np.asarray(array, np.float64).ravel()
    return dict(zip(OPS, (flat.min(), flat.max(), flat.mean(), np.sqrt((flat * flat).sum()))))


def test_allreduce_statistics_of_each_rank_against_numpy(run):
    base, logs = run
    sent = [np.load(base / f"sent_rank{r}.npz") for r in range(RANKS)]
    for rank in range(RANKS):
        assert "patched in training: True; after close: False" in logs[rank]
        (events,) = glob.glob(str(base / "stats" / f"*-rank{rank}-*" / f"rank_{rank}"))
        tags = scalars(events)
        # cc_pre / cc_post per call of the step (0: the weight's gradient, 1: the bias's) and statistic
        pattern = r"(cc_pre|cc_post)/AllReduce\.kj600_cc_worker\.py\[\d+\]\.([01])\.(input|output)/(\w+)"
        seen = set()
        for tag, points in tags.items():
            kind, call, role, op = re.fullmatch(pattern, tag).groups()
            assert role == ("input" if kind == "cc_pre" else "output")
            assert sorted(points) == list(range(STEPS))
            for step, value in points.items():
                mine = sent[rank][f"{step}_grad{call}"]
                array = mine if kind == "cc_pre" else sent[0][f"{step}_grad{call}"] + sent[1][f"{step}_grad{call}"]
                want = numpy_stats(array)[op]
                assert value == pytest.approx(want, rel=1e-5, abs=1e-7), (rank, tag, step)
            seen.add((kind, call, op))
        assert seen == {(k, c, op) for k in ("cc_pre", "cc_post") for c in "01" for op in OPS}
    # the ranks' inputs differ, so pre and post tell a rank's own gradient from the reduced one
    assert not np.allclose(sent[0]["0_grad0"], sent[1]["0_grad0"])


def test_cc_log_only_without_an_optimizer_stops_at_the_second_step(run):
    _, logs = run
    for rank in range(RANKS):
        log = logs[rank]
        assert re.search(r"mindmon: collective AllReduce, input dtype Float32, group mccl_world_group, called from:\n"
                         r"    \S+kj600_cc_worker\.py\[\d+\]", log), log[-3000:]
        assert "training stopped at the first forward of the second step as configured" in log
        assert "stopped: code 0 at step 1; patched: False" in log
