"""`Record.many` and `TensorStatsRecord.for_tensors`: the records the constructors make, field for field,
still frozen."""
import dataclasses

import pytest

from mindmon.core.records import Record, TensorStatsRecord

pytestmark = pytest.mark.ms27


def test_many_makes_the_constructors_records():
    names, values = ["fc1.weight", "1:fc2.bias"], [[0.5, -1.0], [2.0, float("nan")]]
    layouts = [((16, 8), "Float32"), ((), "Float16")]
    made = TensorStatsRecord.for_tensors(3, None, 2, "grad_reduced", names, values, ("min", "max"), layouts)
    built = [TensorStatsRecord(3, None, 2, "grad_reduced", name, value, ops=("min", "max"), shape=shape, dtype=dtype)
             for name, value, (shape, dtype) in zip(names, values, layouts)]
    assert [dataclasses.asdict(r) for r in made] == [dataclasses.asdict(r) for r in built]
    assert [repr(r) for r in made] == [repr(r) for r in built]
    assert made[0] == built[0] and made[0].iteration is None and made[1].stat("max") != made[1].stat("max")
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].step = 4


def test_record_many_makes_the_constructors_records():
    made = Record.many(5, 1, 3, "local_norm", ["a", "b"], [0.25, 1e-9])
    built = [Record(5, 1, 3, "local_norm", "a", 0.25), Record(5, 1, 3, "local_norm", "b", 1e-9)]
    assert made == built and [repr(r) for r in made] == [repr(r) for r in built]
    assert type(made[0]) is Record and hash(made[0]) == hash(built[0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[1].value = 2.0
