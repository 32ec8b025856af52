"""Golden lines: every documented log-line kind, to the character, from hand-built records.

tests/formats/test_log_format.py checks the train_state lines of one ordinary step; these cover the other
kinds (tokens per expert, max logits, the profiler's line, the Megatron file) and the values whose
printing is easy to get subtly wrong (negative increments, rounding, non-finite values, wide steps).
"""
import logging
import os

from mindmon.features.profiler.callback import ProfilerCallback, ProfileWindow
from mindmon.features.profiler.config import ProfilerConfig
from mindmon.core.engine import RunInfo
from mindmon.formats.log_lines import format_lines
from mindmon.core.records import Record
from mindmon.sinks.log import LogSink
from mindmon.features.moe_tokens.sink import MegatronTokensPerExpertSink

LAYER = "decoder.layers.0.self_attention.core_attention.max_logits_val"


def _logged_lines(records, caplog, max_steps=None):
    """The lines LogSink sends to its logger for one step's records, after open(RunInfo)."""
    logger = logging.getLogger("mindmon-golden")
    sink = LogSink(logger)
    sink.open(RunInfo(rank=0, max_steps=max_steps))
    with caplog.at_level(logging.INFO, logger="mindmon-golden"):
        sink.write(records)
    sink.close()
    # the lines, however many logger calls carry them
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "mindmon-golden").splitlines()


def test_tokens_per_expert_line_keeps_its_spaces(caplog):
    records = [Record(1, 2, 0, "tokens_per_expert", "decoder.layers.1", [2, 4, 6, 8], 2)]
    assert _logged_lines(records, caplog) == [
        '{"iter": 2, "step": 1, "micro_step": 2, "block": "decoder", "layer": 1, "tpe": [[2, 4, 6, 8]]}']


def test_tokens_per_expert_line_of_an_mtp_layer():
    records = [Record(1, 2, 0, "tokens_per_expert", "mtp.layers.0", [14, 16, 15, 15], 2)]
    assert format_lines(records) == [
        '{"iter": 2, "step": 1, "micro_step": 2, "block": "mtp", "mtp_idx": 0, "layer": 0, "tpe": [[14, 16, 15, 15]]}']


def test_micro_step_block_order_with_tokens_per_expert():
    """Per micro-step: marker, norms, loss, then the tokens-per-expert lines; micro_norm prints nothing."""
    records = [
        Record(7, 0, 0, "tokens_per_expert", "decoder.layers.1", [0, 12, 3, 1], 21),
        Record(7, 0, 0, "local_loss", "loss", 5.0),
        Record(7, 0, 0, "micro_norm", "a.weight", 3.0),
        Record(7, 0, 0, "local_norm", "a.weight", 0.25),
        Record(7, 0, 0, "local_norm", "b.bias", -0.0001234),
    ]
    assert format_lines(records) == [
        '{ "step": 7, "micro_step": 0 }',
        '{ "local_norm": a.weight: 0.250000 }',
        '{ "local_norm": b.bias: -0.000123 }',
        '{ "micro_step": 0, "local_loss": 5.0 }',
        '{"iter": 21, "step": 7, "micro_step": 0, "block": "decoder", "layer": 1, "tpe": [[0, 12, 3, 1]]}',
    ]


def test_train_state_values_round_and_print_non_finite():
    records = [
        Record(3, 1, 0, "local_loss", "loss", 12345.6789123456),
        Record(3, 1, 0, "local_norm", "w", float("nan")),
        Record(3, None, 0, "device_norm", "w", float("inf")),
        Record(3, None, 0, "device_norm", "v", 1234567.0000004),
        Record(3, None, 0, "device_loss", "loss", float("nan")),
    ]
    assert format_lines(records) == [
        '{ "step": 3, "micro_step": 1 }',
        '{ "local_norm": w: nan }',
        '{ "micro_step": 1, "local_loss": 12345.678912 }',
        '{ "step": 3 }',
        '{ "device_norm": w: inf }',
        '{ "device_norm": v: 1234567.000000 }',
        '{ "step": 3, "device_loss": nan }',
    ]


def test_max_logit_lines(caplog):
    records = [
        Record(2, None, 0, "max_attention_logit", LAYER, [1.5, 12.25]),
        Record(2, None, 0, "max_attention_logit_mean", "all", 4.21875),
        Record(2, None, 0, "max_attention_logit_max", "all", 12.25),
    ]
    assert _logged_lines(records, caplog, max_steps=10) == [
        f"step:[    2/   10] max_attention_logit/{LAYER}: [1.5, 12.25]",
        "step:[    2/   10] max_attention_logit/mean: 4.219",
        "step:[    2/   10] max_attention_logit/max: 12.25",
    ]


def test_max_logit_lines_wide_steps_unknown_total_and_non_finite():
    records = [
        Record(123456, None, 0, "max_attention_logit", "layer", [123.456789, float("nan"), float("inf"), 0.000123456]),
        Record(3, None, 0, "max_attention_logit_max", "all", float("-inf")),
    ]
    assert format_lines(records, max_steps=None) == [
        "step:[123456/    ?] max_attention_logit/layer: [123.5, nan, inf, 0.0001235]",
        "step:[    3/    ?] max_attention_logit/max: -inf",
    ]
    assert format_lines(records[1:], max_steps=100000) == ["step:[    3/100000] max_attention_logit/max: -inf"]


def test_megatron_file_lines(tmp_path):
    """One line per (step, layer), one inner list per micro-step, `iter` = the step."""
    sink = MegatronTokensPerExpertSink(str(tmp_path))
    sink.open(RunInfo(rank=3))
    sink.write([Record(3, 0, 3, "tokens_per_expert", "decoder.layers.1", [5, 3, 4, 4], 4),
                Record(3, 0, 3, "tokens_per_expert", "mtp.layers.0", [1, 0, 3, 12], 4),
                Record(3, 1, 3, "tokens_per_expert", "decoder.layers.1", [6, 2, 4, 4], 5),
                Record(3, None, 3, "tokens_per_expert_step", "decoder.layers.1", [11, 5, 8, 8])])
    sink.close()
    assert (tmp_path / "tokens_per_expert" / "rank3.jsonl").read_text() == (
        '{"iter": 3, "block": "decoder", "layer": 1, "tpe": [[5, 3, 4, 4], [6, 2, 4, 4]]}\n'
        '{"iter": 3, "block": "mtp", "mtp_idx": 0, "layer": 0, "tpe": [[1, 0, 3, 12]]}\n')


def test_profiler_written_to_line(tmp_path, caplog):
    """The line built when MindSpore reports the trace ready; the trace folder MindSpore would make is
    made here by the stand-in for its trace handler (no profiler runs)."""
    config = ProfilerConfig.parse("profiler", {"enable_profiling": True, "start_step": 3, "end_step": 5,
                                   "output_path": str(tmp_path)})
    callback = ProfilerCallback(config, rank=0, logger=logging.getLogger("mindmon-golden"))
    callback.window = ProfileWindow(first=3, last=5, skip_first=1, warmup=1)
    trace = os.path.join(str(tmp_path), "rank_0", "vm_12465_20261129101847113_ascend_ms")
    callback._write_trace = lambda prof: os.makedirs(trace)
    with caplog.at_level(logging.INFO, logger="mindmon-golden"):
        callback._on_trace_ready(None)
    assert callback.trace_dir == trace
    assert caplog.messages == [
        f"mindmon: profiler: steps 3-5 written to {trace}; open {trace}/ASCEND_PROFILER_OUTPUT/trace_view.json in "
        f"https://ui.perfetto.dev or chrome://tracing (MindStudio Insight opens the folder), or run: "
        f"mindmon profile-summary {trace}"]
