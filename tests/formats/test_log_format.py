"""The documented train_state log lines, to the character."""
import re

from mindmon.core.records import Record
from mindmon.formats.log_lines import format_lines
from mindmon.sinks.log import LogSink


def test_lines_in_order_and_to_the_character():
    records = [
        Record(4, 2, 0, "local_loss", "loss", 0.123),
        Record(4, 2, 0, "local_norm", "decoder.layers.0.self_attention.q_layernorm.weight", 0.000381),
        Record(4, 2, 0, "micro_norm", "decoder.layers.0.self_attention.q_layernorm.weight", 0.5),
        Record(4, 1, 0, "local_norm", "embedding.word_embeddings.weight", 1.5),
        Record(4, 1, 0, "local_loss", "loss", 2.5),
        Record(4, None, 0, "device_norm", "embedding.word_embeddings.weight", 12.3456789),
        Record(4, None, 0, "device_loss", "loss", 1.23456789),
    ]
    assert format_lines(records) == [
        '{ "step": 4, "micro_step": 1 }',
        '{ "local_norm": embedding.word_embeddings.weight: 1.500000 }',
        '{ "micro_step": 1, "local_loss": 2.5 }',
        '{ "step": 4, "micro_step": 2 }',
        '{ "local_norm": decoder.layers.0.self_attention.q_layernorm.weight: 0.000381 }',
        '{ "micro_step": 2, "local_loss": 0.123 }',
        '{ "step": 4 }',
        '{ "device_norm": embedding.word_embeddings.weight: 12.345679 }',
        '{ "step": 4, "device_loss": 1.234568 }',
    ]


def test_no_marker_without_norms():
    lines = format_lines([Record(1, 0, 0, "local_loss", "loss", 3.0)])
    assert lines == ['{ "micro_step": 0, "local_loss": 3.0 }']


def test_lines_go_through_the_given_logger(caplog):
    import logging

    logger = logging.getLogger("mindmon-test")
    with caplog.at_level(logging.INFO, logger="mindmon-test"):
        LogSink(logger).write([Record(2, None, 0, "device_loss", "loss", 0.5)])
    assert [r.getMessage() for r in caplog.records] == ['{ "step": 2, "device_loss": 0.5 }']


SEED_PATTERNS = {
    "marker": re.compile(r'^\{ "step": \d+, "micro_step": \d+ \}$'),
    "local_norm": re.compile(r'^\{ "local_norm": [\w.]+: \d+\.\d{6} \}$'),
    "local_loss": re.compile(r'^\{ "micro_step": \d+, "local_loss": \d+\.\d+ \}$'),
    "step_marker": re.compile(r'^\{ "step": \d+ \}$'),
    "device_norm": re.compile(r'^\{ "device_norm": [\w.]+: \d+\.\d{6} \}$'),
    "device_loss": re.compile(r'^\{ "step": \d+, "device_loss": \d+\.\d+ \}$'),
}
