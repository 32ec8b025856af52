"""cc_distribution through kj600's hook_modules, on two real msrun workers on CPU (mccl): AllReduce wrapped
while training and restored after close; the statistics of what each rank's AllReduce took and gave, read
back from kj600's TensorBoard (each rank's own run folder, msprobe's tags) with TensorBoard's reader, against
numpy on the gradients the ranks sent;
cc_log_only without an optimizer logging the calls and stopping cleanly at the second step."""
import glob
import json
import re

import numpy as np
import pytest

from tests.support.msrun_launch import run_workers

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
        (events,) = glob.glob(str(base / "stats" / f"*-rank{rank}-*"))   # the rank's run folder holds its events
        tags = scalars(events)
        # msprobe's spelling: <function>/rank<r>/<pre|post>_<call>_<tensor>_<op>, the function's calls counted
        # within the step wherever they are made (0: the weight's gradient, 1: the bias's, 2: the loss, from
        # another line), one tensor per call
        seen = set()
        for tag, points in tags.items():
            match = re.fullmatch(r"AllReduce/rank(\d)/(pre|post)_([012])_0_(\w+)", tag)
            assert match, tag
            found_rank, prefix, call, op = match.groups()
            assert int(found_rank) == rank
            assert sorted(points) == list(range(STEPS))
            for step, value in points.items():
                key = f"{step}_loss" if call == "2" else f"{step}_grad{call}"
                array = sent[rank][key] if prefix == "pre" else sent[0][key] + sent[1][key]
                want = numpy_stats(array)[op]
                assert value == pytest.approx(want, rel=1e-5, abs=1e-7), (rank, tag, step)
            seen.add((prefix, call, op))
        assert seen == {(p, c, op) for p in ("pre", "post") for c in "012" for op in OPS}
    # the ranks' inputs differ, so pre and post tell a rank's own gradient from the reduced one
    assert not np.allclose(sent[0]["0_grad0"], sent[1]["0_grad0"])


def test_anomaly_dump_names_the_calls_in_msprobes_spelling(run):
    """A rule firing on every output norm: the dump's tag_name is msprobe's, its step 0-based, its value numpy's."""
    base, _ = run
    sent = [np.load(base / f"sent_rank{r}.npz") for r in range(RANKS)]
    for rank in range(RANKS):
        with open(base / "stats" / "anomaly_detected" / f"rank{rank}" / "anomaly.json") as handle:
            entries = list(json.load(handle).values())
        got = {(e["tag_name"], e["step"]): e["value"] for e in entries}
        keys = {0: "grad0", 1: "grad1", 2: "loss"}
        expected = {(f"AllReduce/rank{rank}/post_{call}_0", step):
                    numpy_stats(sent[0][f"{step}_{key}"] + sent[1][f"{step}_{key}"])["norm"]
                    for call, key in keys.items() for step in range(STEPS)}
        assert set(got) == set(expected), got
        for key, value in got.items():
            assert value == pytest.approx(expected[key], rel=1e-5), key


def test_cc_log_only_without_an_optimizer_stops_at_the_second_step(run):
    _, logs = run
    for rank in range(RANKS):
        log = logs[rank]
        assert re.search(r"mindmon: collective AllReduce, input dtype Float32, group mccl_world_group, called from:\n"
                         r"    \S+kj600_cc_worker\.py\[\d+\]", log), log[-3000:]
        assert "training stopped at the first forward of the second step as configured" in log
        assert "stopped: code 0 at step 1; patched: False" in log
