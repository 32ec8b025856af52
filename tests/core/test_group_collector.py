"""A step end makes thousands of short-lived records; Python's cycle collector must not run over them (it
moved them to older generations, which brought on a full collection every few steps), and the program's own
collector setting must be what it was afterwards. Switched back on after them, the collector may run once over
the youngest generation (CPython counts a small tuple freed to its free list as still allocated, so the step
end's shape tuples leave the count high): no record is alive then."""
import csv
import gc

import mindspore as ms
import numpy as np
import pytest

from mindmon.core.group import MonitorGroup
from mindmon.core.records import TensorStatsRecord
from mindmon.features.tensor_stats.monitor import TensorStatsMonitor
from mindmon.features.tensor_stats.sink import MsprobeCsvSink

TENSORS = 3000   # rows at one step end: above 700 allocations, the collector's first threshold, several times
# This test's tensor names: records that other tests in the process left alive are not counted
PREFIX = "collector_probe"


def _group_with_rows(tmp_path):
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(5 + i % 11).astype(np.float32) for i in range(TENSORS)]
    monitor = TensorStatsMonitor(("min", "max", "norm"), on_host=True)
    group = MonitorGroup([monitor], [MsprobeCsvSink(str(tmp_path), ndigits=6)])
    group.setup(max_steps=1)
    named = [(f"{PREFIX}.cell{i}.output", ms.Tensor(a)) for i, a in enumerate(arrays)]
    group.record("actv", named, {"micro_step": 0})
    return group, arrays


def _flush_counting_collections(group):
    """(generation, records alive) of each collection that starts while the group flushes."""
    collections = []

    def callback(phase, info):
        if phase == "start":
            # type(), not isinstance(): isinstance raises on a weak proxy whose object is gone
            alive = sum(type(o) is TensorStatsRecord and o.name.startswith(PREFIX) for o in gc.get_objects())
            collections.append((info["generation"], alive))
    gc.collect()   # the count of allocations starts from 0: a collection now means the step end's own
    gc.callbacks.append(callback)
    try:
        group.flush(1)
    finally:
        gc.callbacks.remove(callback)
    return collections


@pytest.mark.parametrize("enabled", [True, False])
def test_no_collection_runs_over_a_step_ends_records_and_the_setting_is_restored(tmp_path, enabled):
    group, arrays = _group_with_rows(tmp_path)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        collections = _flush_counting_collections(group)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
        group.close()
    assert collections in ([], [(0, 0)]) if enabled else collections == [], collections
    rows = list(csv.DictReader(open(next(tmp_path.rglob("actv_*.csv")))))
    assert len(rows) == TENSORS
    for i in (0, 1234, TENSORS - 1):   # the rows are the tensors' statistics (numpy, float64)
        row = next(r for r in rows if r["name"] == f"{PREFIX}.cell{i}.output")
        expected = arrays[i].astype(np.float64)
        assert float(row["min"]) == pytest.approx(expected.min(), abs=1e-6)
        assert float(row["max"]) == pytest.approx(expected.max(), abs=1e-6)
        assert float(row["norm"]) == pytest.approx(np.linalg.norm(expected), rel=1e-5)
