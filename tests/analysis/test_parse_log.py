"""`mindmon parse-log`: the demo's own MindFormers log gives back the records of its JSONL (to the
printed precision), and the upstream line formats are read as documented."""
import subprocess
import sys

import pytest

from tests.support.jsonl import read_jsonl

# Kinds that have no log line: only the JSONL has them.
JSONL_ONLY = {"micro_norm", "tokens_per_expert_step", "moe_max_over_mean", "moe_cv", "moe_min_tokens", "moe_max_tokens", "moe_idle_experts",
              "max_norm"}


def tolerance(kind, value):
    """Half a unit of the last printed digit: norms and losses have 6 decimals, the lr 7 significant
    digits (%10.6e), max logits 4 significant digits; token counts and samples are exact."""
    if kind in ("local_norm", "device_norm", "local_loss", "device_loss", "loss", "grad_norm"):
        return 5e-7 + 1e-12
    if kind == "learning_rate":
        return abs(value) * 5e-7
    if kind.startswith("max_attention_logit"):   # per layer, and the mean / max over all heads
        return abs(value) * 5e-4
    return 0.0


def key(row):
    return (row["step"], row["micro_step"], row["kind"], row["name"])


def test_demo_log_gives_back_the_jsonl(view_demo, tmp_path):
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "parse-log",
                             str(view_demo / "log" / "rank_0" / "info.log"), "-o", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "0 unreadable" in result.stdout
    recorded = {key(r): r for r in read_jsonl(view_demo / "monitor" / "rank_0" / "metrics.jsonl")
                if r["kind"] not in JSONL_ONLY}
    parsed_rows = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    parsed = {key(r): r for r in parsed_rows}
    assert len(parsed) == len(parsed_rows)   # no record twice
    assert set(parsed) == set(recorded)
    kinds = {k[2] for k in recorded}
    assert {"local_norm", "device_norm", "local_loss", "device_loss", "loss", "grad_norm", "learning_rate",
            "samples", "max_attention_logit", "tokens_per_expert"} <= kinds
    for k, row in recorded.items():
        got = parsed[k]
        assert got.get("iter") == row.get("iter"), k
        values = row["value"] if isinstance(row["value"], list) else [row["value"]]
        parsed_values = got["value"] if isinstance(got["value"], list) else [got["value"]]
        assert len(parsed_values) == len(values), k
        for want, have in zip(values, parsed_values):
            assert abs(have - want) <= tolerance(k[2], want), (k, want, have)


UPSTREAM_LOG = """\
2026-11-29 10:15:05,520 - mindformers/output/log[mindformers/pynative/trainer/trainer.py:311] - INFO - Calculate global_batch_size=16, num_accumulation_steps=2.
2026-11-29 10:15:05,521 - mindformers/output/log[mindformers/pynative/trainer/trainer.py:599] - INFO - Start training loop...
[INFO] 2026-11-29 10:15:06,001 [mindformers/pynative/callback/loss_callback.py:190] _print_log: { step:[    3/   10], loss:   4.844477, per_step_time:   2251ms, lr: 1.000000e-04, grad_norm:   0.731000, throughput:   1.50T }
[INFO] 2026-11-29 10:15:06,003 [monitor.py:11] flush: {"step": 3, "micro_step": 1, "local_loss": 2.5}
[INFO] 2026-11-29 10:15:06,002 [monitor.py:10] flush: { "local_norm": embedding.word_embeddings.weight:   1.500000 }
[INFO] 2026-11-29 10:15:06,004 [monitor.py:12] flush: {"iter": 5, "step": 3, "micro_step": 1, "block": "decoder", "layer": 1, "tpe": [[2, 4, 6, 8]]}
[INFO] 2026-11-29 10:15:06,005 [monitor.py:13] flush: {"iter": 5, "step": 3, "micro_step": 1, "block": "mtp", "mtp_idx": 0, "layer": 0, "tpe": [[1, 0, 3, 12]]}
[INFO] 2026-11-29 10:15:06,006 [callback.py:333] call_event: step:[    3/   10] max_attention_logit/decoder.layers.0.self_attention.core_attention.max_logits_val: [1.5, 12.25]
[INFO] 2026-11-29 10:15:06,007 [callback.py:333] call_event: step:[    3/   10] max_attention_logit/mean: 6.875
[INFO] 2026-11-29 10:15:06,008 [callback.py:333] call_event: step:[    3/   10] max_attention_logit/max: 12.25
[WARNING] 2026-11-29 10:15:06,009 [trainer.py:1] x: something unrelated
[INFO] 2026-11-29 10:15:06,010 [monitor.py:14] flush: { "local_norm": truncated.weight:
{"iter": 6, "block": "decoder", "layer": 2, "tpe": [[3, 1], [0, 4]]}
2026-11-29 10:15:07,000 - mindformers/output/log[group.py:86] - INFO - { step:[    4/   10], loss:   4.500000, per_step_time:   2100ms, lr: 2.000000e-04, grad_norm: NaN, throughput:   1.50T }
"""


def test_upstream_formats(tmp_path):
    from mindmon.analysis.parse_log import parse_log

    log = tmp_path / "worker_2.log"
    log.write_text(UPSTREAM_LOG)
    counts = parse_log(str(log), str(tmp_path / "out"), progress=None)
    rows = [(r["step"], r["micro_step"], r["rank"], r["kind"], r["name"], r["value"], r.get("iter"))
            for r in read_jsonl(tmp_path / "out" / "rank_2" / "metrics.jsonl")]
    assert rows == [
        (3, None, 2, "loss", "loss", 4.844477, None),
        (3, None, 2, "learning_rate", "lr", 1e-4, None),
        (3, None, 2, "grad_norm", "global", 0.731, None),
        (3, None, 2, "samples", "consumed", 48.0, None),   # step x global_batch_size=16
        (3, 1, 2, "local_loss", "loss", 2.5, None),
        (3, 1, 2, "local_norm", "embedding.word_embeddings.weight", 1.5, None),   # step/micro-step of the line above
        (3, 1, 2, "tokens_per_expert", "decoder.layers.1", [2, 4, 6, 8], 5),
        (3, 1, 2, "tokens_per_expert", "mtp.layers.0", [1, 0, 3, 12], 5),
        (3, None, 2, "max_attention_logit", "decoder.layers.0.self_attention.core_attention.max_logits_val",
         [1.5, 12.25], None),
        (3, None, 2, "max_attention_logit_mean", "all", 6.875, None),   # the summaries are records too
        (3, None, 2, "max_attention_logit_max", "all", 12.25, None),
        (6, 0, 2, "tokens_per_expert", "decoder.layers.2", [3, 1], None),   # Megatron: iter = step, one list per micro-batch
        (6, 1, 2, "tokens_per_expert", "decoder.layers.2", [0, 4], None),
        (4, None, 2, "loss", "loss", 4.5, None),   # grad_norm: NaN = the trainer gave none: no record
        (4, None, 2, "learning_rate", "lr", 2e-4, None),
        (4, None, 2, "samples", "consumed", 64.0, None),
    ]
    assert counts.malformed == 1 and "truncated.weight" in counts.first_malformed[0]
    assert counts.other == 2 and counts.lines == len(UPSTREAM_LOG.splitlines())


def test_local_loss_lines_without_markers_follow_the_steps():
    """Only local_loss switched on: no marker carries the step, so a micro-step that does not move
    forward starts the next step."""
    from mindmon.analysis.parse_log import LogParser

    parser = LogParser()
    lines = ['{ step:[    1/    2], loss: 1.0, per_step_time: 5ms, grad_norm: 1.0 }']
    lines += [f'{{ "micro_step": {k}, "local_loss": {k + 0.5} }}' for k in range(2)] * 2
    records = [r for line in lines for r in parser.feed(line)]
    assert [(r.step, r.micro_step, r.value) for r in records if r.kind == "local_loss"] == \
        [(1, 0, 0.5), (1, 1, 1.5), (2, 0, 0.5), (2, 1, 1.5)]


def test_missing_log_is_a_clear_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "parse-log", str(tmp_path / "nope.log"),
                             "-o", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "nope.log" in result.stderr


@pytest.mark.parametrize("path,rank", [("/x/log/rank_3/info.log", 3), ("/x/msrun/worker_1.log", 1), ("/x/a.log", 0)])
def test_rank_from_path(path, rank):
    from mindmon.analysis.parse_log import rank_of

    assert rank_of(path) == rank
