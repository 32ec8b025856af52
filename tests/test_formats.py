"""The format modules: what the fast writers produce is exactly what the documented layout says."""
import json

import pytest

from mindmon.formats import jsonl
from mindmon.records import Record


@pytest.mark.parametrize("value", [0.1, 1e-05, 123456789.123, 5e-324, 1.0, 0.0, -2.5, 1e300, 7])
@pytest.mark.parametrize("name", ["decoder.layers.0.mlp.weight", 'odd"name\\with\tescapes', "ünïcode"])
@pytest.mark.parametrize("micro_step", [None, 3])
def test_jsonl_line_is_json_dumps_of_the_fields(value, name, micro_step):
    record = Record(2, micro_step, 1, "local_norm", name, value)
    expected = json.dumps({"step": 2, "micro_step": micro_step, "rank": 1, "kind": "local_norm", "name": name,
                           "value": value})
    assert jsonl.encode(record) == expected
    assert jsonl.decode(expected) == record


def test_a_step_is_one_logging_call_with_every_line(caplog):
    import logging

    from mindmon.sinks.log import LogSink

    records = [Record(3, 0, 0, "local_loss", "loss", 2.5), Record(3, None, 0, "device_loss", "loss", 2.25)]
    with caplog.at_level(logging.INFO, logger="mindmon-formats"):
        LogSink(logging.getLogger("mindmon-formats")).write(records)
    assert [r.getMessage() for r in caplog.records] == [
        '{ "micro_step": 0, "local_loss": 2.5 }\n{ "step": 3, "device_loss": 2.25 }']
