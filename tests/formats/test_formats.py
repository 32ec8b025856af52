"""The format modules: what the fast writers produce is exactly what the documented layout says."""
import json

import pytest

from mindmon.formats import jsonl
from mindmon.core.records import Record


@pytest.mark.parametrize("value", [0.1, 1e-05, 123456789.123, 5e-324, 1.0, 0.0, -2.5, 1e300, 7])
@pytest.mark.parametrize("name", ["decoder.layers.0.mlp.weight", 'odd"name\\with\tescapes', "ünïcode"])
@pytest.mark.parametrize("micro_step", [None, 3])
def test_jsonl_line_is_json_dumps_of_the_fields(value, name, micro_step):
    record = Record(2, micro_step, 1, "local_norm", name, value)
    expected = json.dumps({"step": 2, "micro_step": micro_step, "rank": 1, "kind": "local_norm", "name": name,
                           "value": value})
    assert jsonl.encode(record) == expected
    assert jsonl.decode(expected) == record


def test_jsonl_lines_of_many_records_are_each_records_line():
    """`encode_many` (field by field over a step's records, the part before the name made once per step,
    micro-step, rank and kind) gives `json.dumps` of each record's fields: over two steps (the second with
    names not seen before), and with a record among them the field-by-field way does not take (NaN, an int,
    a list value, an iteration, a tensor-statistics record)."""
    import math

    from mindmon.core.records import TensorStatsRecord

    def expected(record):
        value = record.value
        fields = {"step": record.step, "micro_step": record.micro_step, "rank": record.rank, "kind": record.kind,
                  "name": record.name, "value": None if isinstance(value, float) and math.isnan(value) else value}
        fields.update({"nonfinite": "nan"} if fields["value"] is None else {})
        fields.update({"iter": record.iteration} if record.iteration is not None else {})
        if isinstance(record, TensorStatsRecord):
            fields.update(ops=list(record.ops), shape=list(record.shape), dtype=record.dtype)
        return json.dumps(fields)

    for step in (1, 2):
        plain = [Record(step, micro, 0, kind, f"layers.{step}.{index}", 0.25 * index - 1.5)
                 for micro in (None, 0, 1) for kind in ("local_norm", "local_loss") for index in range(4)]
        assert jsonl.encode_many(plain) == [expected(record) for record in plain]
        others = [Record(step, None, 3, "odd", "nan", math.nan), Record(step, 0, 3, "count", "int", 7),
                  Record(step, 0, 3, "tokens", "list", [1, 2]), Record(step, 0, 3, "tokens", "it", 1.5, iteration=9),
                  TensorStatsRecord(step, None, 3, "grad_reduced", "w", [0.5], ops=("min",), shape=(2,),
                                    dtype="Float32")]
        for other in others:
            mixed = plain[:3] + [other] + plain[3:6]
            assert jsonl.encode_many(mixed) == [expected(record) for record in mixed]


def test_a_step_is_one_logging_call_with_every_line(caplog):
    import logging

    from mindmon.sinks.log import LogSink

    records = [Record(3, 0, 0, "local_loss", "loss", 2.5), Record(3, None, 0, "device_loss", "loss", 2.25)]
    with caplog.at_level(logging.INFO, logger="mindmon-formats"):
        LogSink(logging.getLogger("mindmon-formats")).write(records)
    assert [r.getMessage() for r in caplog.records] == [
        '{ "micro_step": 0, "local_loss": 2.5 }\n{ "step": 3, "device_loss": 2.25 }']
