"""The collectives through msprobe's front doors, on two real msrun workers on CPU (tests/support/msprobe_cc_worker.py):

- monitor_v2's `monitors.cc`: the `cc_step0-2.csv` file of each rank, its header and every row against numpy
  of the tensors the ranks sent (msprobe's own monitor_v2 sees only `comm_func` calls, which have no CPU
  kernel in MindSpore: there is no msprobe file to compare with on CPU, docs/msprobe.md);
- TrainerMon's msprobe CSV names the rows as msprobe does (`AllReduce.output`, in call order), and its
  TensorBoard tags carry msprobe's call index, which counts from attaching on (step 0's calls, made but not
  collected, included) instead of starting again each step;
- every tag of that run's TensorBoard reads back (`read_tag`) into parts that spell it again (`format_tag`)
  and name the kind, the tensor and the rank it was written for.
"""
import glob
import os
import re

import numpy as np
import pytest

from tests.support.msprobe_cc_worker import OPS, STEPS
from tests.support.msrun_launch import run_workers
from mindmon.formats.msprobe_csv import read_csv
from mindmon.formats.msprobe_tags import format_tag, read_tag

RANKS = 2
GRADS = 4   # the model's parameters: wq.weight, wk.weight, out.weight, out.bias


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("msprobe_cc")
    result, logs = run_workers("msprobe_cc_worker.py", [base], base)
    assert result.returncode == 0, result.stdout[-2000:] + "".join(t[-3000:] for t in logs.values())
    for rank in range(RANKS):
        assert "v2 done; patched after close: False" in logs[rank]
        assert "v1 done; patched after close: False" in logs[rank]
    return base


def sent(base, run_name):
    """[rank] -> {key: float32 array} of what each rank sent."""
    return [dict(np.load(base / f"{run_name}_sent_rank{r}.npz")) for r in range(RANKS)]


def communicated(tensors, step, rank, with_metric):
    """[(function, role, call within the step, float32 array)] in call order: what went into and came out
    of each collective, as float32 arrays (the reduction of two float32 tensors is one float32 addition)."""
    calls = []
    for i in range(GRADS):
        calls.append(("AllReduce", i, tensors[rank][f"{step}_grad{i}"],
                      tensors[0][f"{step}_grad{i}"] + tensors[1][f"{step}_grad{i}"]))
    calls.append(("AllGather", 0, tensors[rank][f"{step}_small"],
                  np.concatenate([tensors[0][f"{step}_small"], tensors[1][f"{step}_small"]])))
    if with_metric:
        calls.append(("AllReduce", GRADS, tensors[rank][f"{step}_metric"],
                      tensors[0][f"{step}_metric"] + tensors[1][f"{step}_metric"]))
    return calls


def numpy_stats(array):
    """min, max, mean, norm, nans of a float32 array: the mean as MindSpore's float32 mean rounds it
    (float32 sum / float32 count), the rest from float64."""
    wide = array.astype(np.float64).ravel()
    mean = np.float32(np.float32(wide.sum()) / np.float32(wide.size))
    return {"min": wide.min(), "max": wide.max(), "mean": float(mean), "norm": np.sqrt((wide * wide).sum()),
            "nans": 0.0}


def test_monitor_v2_cc_file_against_numpy(run):
    tensors = sent(run, "v2")
    for rank in range(RANKS):
        folder = run / "v2" / f"rank_{rank}"
        assert sorted(os.listdir(folder)) == [f"cc_step0-{STEPS - 1}.csv"]
        lines = (folder / f"cc_step0-{STEPS - 1}.csv").read_text().splitlines()
        assert lines[0].split(",") == ["vpp_stage", "step", "module_name", "scope"] + OPS
        rows = {}
        for line in lines[1:]:
            stage, step, name, scope, *values = line.split(",")
            assert (stage, scope) == ("", "comm") and (step, name) not in rows
            rows[(int(step), name)] = values
        expected = {}
        for step in range(STEPS):   # the metric's AllReduce is outside cc_codeline: no row
            for function, call, given, got in communicated(tensors, step, rank, with_metric=False):
                expected[(step, f"{function}/rank{rank}/pre_{call}_0")] = given
                expected[(step, f"{function}/rank{rank}/post_{call}_0")] = got
        assert set(rows) == set(expected)
        for key, array in expected.items():
            want = numpy_stats(array)
            for op, text in zip(OPS, rows[key]):
                assert text == repr(float(np.float32(float(text)))), (key, op, text)   # a float32, as msprobe
                if op in ("min", "max", "mean", "nans"):   # exact: the float32 data's own values
                    assert float(text) == float(np.float32(want[op])), (key, op, text, want[op])
                else:
                    assert float(text) == pytest.approx(want[op], rel=1e-6), (key, op, text, want[op])


def test_trainer_mon_csv_names_are_msprobes_in_call_order(run):
    tensors = sent(run, "v1")
    for rank in range(RANKS):
        (folder,) = glob.glob(str(run / "v1" / f"*-rank{rank}-*"))
        for kind, role in (("cc_pre", "input"), ("cc_post", "output")):
            for step in range(1, STEPS):   # start_step 1: step 0 is not written
                records = read_csv(os.path.join(folder, f"{kind}_{step}-{step}.csv"), rank)
                calls = communicated(tensors, step, rank, with_metric=True)
                assert [r.name for r in records] == [f"{function}.{role}" for function, *_ in calls]
                for record, (_, _, given, got) in zip(records, calls):
                    want = numpy_stats(given if role == "input" else got)
                    assert record.step - 1 == step and record.ops == tuple(OPS)
                    # msprobe's CSV rounds to 6 decimals (ndigits): half a unit of the 6th decimal
                    assert record.value == pytest.approx([want[op] for op in OPS], rel=1e-6, abs=5.01e-7)


def tensorboard_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(folder, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def test_trainer_mon_call_index_runs_over_steps(run):
    """Five AllReduce calls and one AllGather per step: step 1's are calls 5-9 and 1, step 2's 10-14 and 2."""
    tensors = sent(run, "v1")
    for rank in range(RANKS):
        tags = tensorboard_scalars(str(run / "v1_tb" / f"rank_{rank}"))
        cc_tags = {t for t in tags if re.match(r"All(Reduce|Gather)/", t)}
        expected = set()
        for step in range(1, STEPS):
            counts = {"AllReduce": (GRADS + 1) * step, "AllGather": step}   # calls made before this step
            for function, call, given, got in communicated(tensors, step, rank, with_metric=True):
                index = counts[function] + (call if function == "AllReduce" else 0)
                for prefix, array in (("pre", given), ("post", got)):
                    want = numpy_stats(array)
                    for op in OPS:
                        tag = f"{function}/rank{rank}/{prefix}_{index}_0_{op}"
                        expected.add(tag)
                        assert tags[tag] == {step: pytest.approx(want[op], rel=1e-5, abs=1e-7)}, tag
        assert cc_tags == expected


def test_every_tag_of_the_run_reads_back(run):
    kinds = set()
    for rank in range(RANKS):
        for tag in tensorboard_scalars(str(run / "v1_tb" / f"rank_{rank}")):
            parts = read_tag(tag)
            assert parts is not None, tag
            assert format_tag(parts) == tag and parts.rank == rank
            assert parts.statistic in OPS + ["entropy", "softmax_max", "entropy_mean", "softmax_max_mean", "sr",
                                             "kernel_norm"], tag
            kinds.add(parts.kind)
            if parts.kind in ("cc_pre", "cc_post"):
                assert parts.vpp_stage is None and parts.name in ("AllReduce", "AllGather") and parts.tensor == 0
            else:
                assert parts.vpp_stage == 0 and parts.call is None
    assert kinds == {"cc_pre", "cc_post", "attention_hook", "linear_hook", "grad_unreduced", "grad_reduced",
                     "param_origin", "param_updated", "actv", "actv_grad"}
    assert read_tag("loss/loss") is None   # mindmon's own tags are not msprobe's
