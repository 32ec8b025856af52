"""On two real msrun workers (CPU, mccl): `module_ranks: [1]` leaves rank 0 out (no folder, no file) while
rank 1 writes its own rows; and csv2tensorboard_by_step with process_num 2 converting both ranks' folders at
once, each rank's TensorBoard (read back with TensorBoard's reader) holding that rank's values. Every value
is compared with the numpy run of the rank's own optimizer."""
import glob
import os
import re

import pytest

from tests.support.msprobe_reference import NAMES, STEPS, adam_weight_decay, adamw_torch, reference_run, statistic
from tests.support.msrun_launch import run_workers
from mindmon.formats.msprobe_csv import read_csv
from mindmon.msprobe import csv2tensorboard_by_step

RANKS = 2
OPS = ("min", "max", "mean", "norm")
KINDS = ("grad_reduced", "grad_unreduced", "param_origin", "param_updated")
REFERENCE = {0: adam_weight_decay, 1: adamw_torch}   # the worker's optimizer per rank


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("module_ranks")
    result, logs = run_workers("module_ranks_worker.py", [base], base, RANKS)
    assert result.returncode == 0, result.stdout[-2000:] + "".join(t[-3000:] for t in logs.values())
    assert all(f"rank {r} done" in logs[r] for r in range(RANKS))
    return base


def close(value, want):
    return abs(value - want) <= 1e-5 * abs(want) + 1e-7


def test_module_ranks_leaves_rank_0_out(run):
    root = run / "one_rank"
    assert not glob.glob(str(root / "*-rank0-*"))
    (folder,) = glob.glob(str(root / "*-rank1-*"))
    reference = reference_run(REFERENCE[1])
    seen = set()
    for path in glob.glob(os.path.join(folder, "*.csv")):
        for record in read_csv(path, 1):
            key = (record.kind, record.step - 1, None, record.name)
            seen.add(key)
            for op, value in zip(record.ops, record.value):
                assert close(value, statistic(reference[key], op)), (key, op)
    assert seen == {(k, s, None, n) for k in KINDS for s in range(STEPS) for n in NAMES}


def test_csv2tensorboard_by_step_with_two_processes(run, tmp_path):
    root = run / "every_rank"
    stamps = sorted(re.match(r"(.*)-rank\d-", os.path.basename(f)).group(1) for f in glob.glob(str(root / "*-rank*-*")))
    assert len(stamps) == RANKS
    written = csv2tensorboard_by_step(str(root), stamps[0], stamps[-1], process_num=2,
                                      data_type_list=list(KINDS), output_dirpath=str(tmp_path / "tb"))
    assert sorted(written) == sorted(str(tmp_path / "tb" / f"rank{r}" / k) for r in range(RANKS) for k in KINDS)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for rank in range(RANKS):
        reference = reference_run(REFERENCE[rank])
        for kind in KINDS:   # msprobe's layout: rank<r>/<data type>/, tags vp0:<name>/<op>, 0-based steps
            accumulator = EventAccumulator(str(tmp_path / "tb" / f"rank{rank}" / kind))
            accumulator.Reload()
            tags = accumulator.Tags()["scalars"]
            assert set(tags) == {f"vp0:{n}/{op}" for n in NAMES for op in OPS}
            for tag in tags:
                name, op = tag[len("vp0:"):].rsplit("/", 1)
                points = {e.step: e.value for e in accumulator.Scalars(tag)}
                assert sorted(points) == list(range(STEPS))
                for step, value in points.items():
                    assert close(value, statistic(reference[(kind, step, None, name)], op)), (rank, tag, step)
    # the two ranks trained with different optimizers: their updated weights differ
    a, b = reference_run(REFERENCE[0]), reference_run(REFERENCE[1])
    assert abs(statistic(a[("param_updated", 0, None, "fc1.weight")], "norm") -
               statistic(b[("param_updated", 0, None, "fc1.weight")], "norm")) > 1e-4
