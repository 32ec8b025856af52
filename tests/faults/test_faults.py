"""What mindmon promises when things go wrong: nothing recorded is lost, nothing it raises reaches the
training code, and non-finite values are kept, written as standard JSON and read back."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mindmon.config import ConfigError
from mindmon.core.engine import RunInfo, SinkClosedError
from mindmon.formats import jsonl
from mindmon.core.records import Record
from mindmon.sinks import JsonlSink
from tests.support import HERE

pytestmark = pytest.mark.serial   # kills the msrun worker it finds among all processes by its command line and RANK_ID

JOB = Path(HERE) / "scripts" / "plain_loop_job.py"


def _job(output_dir, steps, *extra, **kwargs):
    return subprocess.Popen([sys.executable, str(JOB), str(output_dir), str(steps), *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _strict_json(line):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(line, parse_constant=refuse)


# --- non-finite values ---------------------------------------------------------------------------

NONFINITE = [Record(3, None, 0, "device_loss", "loss", float("nan")),
             Record(3, 1, 0, "local_norm", "w", float("inf")),
             Record(3, None, 0, "grad_norm", "global", float("-inf")),
             Record(3, None, 0, "max_attention_logit", "layer", [1.5, float("nan"), float("inf")])]


def test_nonfinite_values_are_standard_json_and_round_trip():
    for record in NONFINITE:
        line = jsonl.encode(record)
        row = _strict_json(line)                       # no bare NaN / Infinity anywhere
        assert "nonfinite" in row
        back = jsonl.decode(line)
        got = back.value if isinstance(back.value, list) else [back.value]
        want = record.value if isinstance(record.value, list) else [record.value]
        assert [repr(v) for v in got] == [repr(v) for v in want]
    assert _strict_json(jsonl.encode(NONFINITE[0]))["value"] is None
    assert _strict_json(jsonl.encode(NONFINITE[3]))["nonfinite"] == {"1": "nan", "2": "inf"}


def test_pandas_reads_nonfinite_lines_as_nan(tmp_path):
    import pandas
    path = tmp_path / "m.jsonl"
    path.write_text("".join(jsonl.encode(r) + "\n" for r in NONFINITE[:3]))
    frame = pandas.read_json(path, lines=True)
    assert frame["value"].isna().all()
    assert [repr(float(v)) for v in frame["nonfinite"]] == ["nan", "inf", "-inf"]   # pandas parses the texts


def test_parse_log_reads_nonfinite_lines():
    from mindmon.analysis.parse_log import LogParser
    from mindmon.formats.log_lines import format_lines

    records = [Record(2, 0, 0, "local_loss", "loss", float("nan")), Record(2, 0, 0, "local_norm", "w", float("inf")),
               Record(2, None, 0, "device_loss", "loss", float("nan")),
               Record(2, None, 0, "max_attention_logit", "a", [float("nan"), 2.0])]
    lines = format_lines(records, max_steps=5)
    assert '{ "micro_step": 0, "local_loss": nan }' in lines and '{ "local_norm": w: inf }' in lines
    parser = LogParser()
    parsed = [r for line in lines for r in parser.feed(line)]
    assert parser.counts.malformed == 0
    assert [(r.kind, r.step, r.micro_step) for r in parsed] == [
        ("local_norm", 2, 0), ("local_loss", 2, 0), ("device_loss", 2, None), ("max_attention_logit", 2, None)]
    assert math.isinf(parsed[0].value) and math.isnan(parsed[1].value) and math.isnan(parsed[3].value[0])


def test_merge_with_a_nan_does_not_depend_on_rank_order(tmp_path):
    from mindmon.analysis.merge import merge

    def write(root, values):
        for rank, value in enumerate(values):
            sink = JsonlSink(str(root))
            sink.open(RunInfo(rank))
            sink.write([Record(1, 0, rank, "local_loss", "loss", value)])
            sink.close()
    results = []
    for order in ([1.0, float("nan"), 3.0], [float("nan"), 3.0, 1.0]):
        root = tmp_path / str(len(results))
        write(root, order)
        path, _ = merge(str(root))
        row = open(path).read().splitlines()[1].split(",")
        results.append(row[5:8])
    assert results[0] == results[1] == ["nan", "nan", "nan"]


class _ModelWithMaxLogits:
    """A model with the documented max-logit interface and fixed values."""

    def __init__(self, values):
        from mindspore import Tensor

        self.values = {name: Tensor(np.array(v, np.float32)) for name, v in values.items()}
        self.resets = 0

    def get_max_attention_logit(self):
        return self.values

    def reset_max_attention_logit(self):
        self.resets += 1


def test_max_logits_keep_nonfinite_heads_and_skip_layers_that_ran_nothing():
    from mindmon.features.max_logits.monitor import MaxAttentionLogitMonitor

    model = _ModelWithMaxLogits({"a": [1.0, float("nan")], "b": [float("inf"), 2.0], "c": [-np.inf, -np.inf]})
    records = MaxAttentionLogitMonitor(model).collect(step=4)
    layers = {r.name: r.value for r in records if r.kind == "max_attention_logit"}
    assert set(layers) == {"a", "b"} and math.isnan(layers["a"][1]) and layers["b"][0] == math.inf
    summary = {r.kind: r.value for r in records if r.name == "all"}
    assert math.isnan(summary["max_attention_logit_mean"]) and math.isnan(summary["max_attention_logit_max"])
    assert model.resets == 1


# --- closing, unwritable folders, two runs into one folder ---------------------------------------

def test_write_after_close_raises_and_does_not_truncate(tmp_path):
    from mindmon import build_group, parse_sections

    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path),
                                                    "train_state": {"device_loss": True}}}))
    group.record("device_loss", 2.5)
    group.flush(step=1)
    group.close()
    with pytest.raises(SinkClosedError, match="after close"):
        group.write([Record(2, None, 0, "device_loss", "loss", 1.0)])
    assert [r.value for r in jsonl.read_records(str(tmp_path / "rank_0" / "metrics.jsonl"))] == [2.5]
    sink = JsonlSink(str(tmp_path / "other"))
    sink.open(RunInfo(0))
    sink.close()
    with pytest.raises(SinkClosedError):
        sink.write([])


def test_unwritable_output_dir_is_a_config_error_naming_the_key(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    sink = JsonlSink(str(blocker / "monitor"))
    with pytest.raises(ConfigError, match=r"^monitor\.output_dir: got .*a_file/monitor.*allowed: a directory"):
        sink.open(RunInfo(0))


def test_a_second_live_run_into_the_same_folder_is_refused(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from mindmon.sinks import JsonlSink; from mindmon.core.engine import RunInfo\n"
        f"s = JsonlSink({str(tmp_path)!r}); s.open(RunInfo(0)); print('open', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(ConfigError, match=rf"a running job \(pid {holder.pid} on .*run\.lock"):
            JsonlSink(str(tmp_path)).open(RunInfo(0))
    finally:
        holder.kill()
        holder.wait()
    sink = JsonlSink(str(tmp_path))   # the holder is gone: its stale lock is taken over
    sink.open(RunInfo(0))
    sink.close()
    assert not (tmp_path / "rank_0" / "run.lock").exists()


# --- faults during training ----------------------------------------------------------------------

def test_full_disk_is_reported_once_and_the_code_after_training_runs(tmp_path):
    job = _job(tmp_path, 6, 4000)
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err
    assert out.splitlines()[-1] == "after train" and "step 6" in out
    assert err.count("JsonlSink failed") == 1 and "File too large" in err
    assert "Traceback" not in err
    lines = (tmp_path / "rank_0" / "metrics.jsonl").read_text().splitlines()
    records = [jsonl.decode(line) for line in lines[:-1]]   # all but a possibly cut last line are whole
    assert records and {r.step for r in records} >= {1}


def test_killed_process_keeps_the_completed_steps(tmp_path):
    job = _job(tmp_path, 10_000)
    try:
        for _ in range(3):
            assert job.stdout.readline().startswith("step")
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    path = tmp_path / "rank_0" / "metrics.jsonl"
    with open(path, "a") as handle:
        handle.write('{"step": 99, "micro_step": 0, "rank": 0, "ki')   # a line cut by the kill
    records = jsonl.read_records(str(path))
    steps = sorted({r.step for r in records})
    assert steps[:3] == [1, 2, 3] and 99 not in steps
    for step in steps[:3]:   # each completed step is whole: K local losses, both device norms, the device loss
        kinds = [r.kind for r in records if r.step == step]
        assert kinds.count("local_loss") == 2 and kinds.count("device_norm") == 2 and kinds.count("device_loss") == 1


def test_unwritable_tensorboard_dir_is_a_config_error_naming_the_key(tmp_path):
    from mindmon.sinks.tensorboard import TensorBoardSink

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^monitor\.tensorboard\.tensorboard_dir: got .*a_file"):
        TensorBoardSink(str(blocker)).open(RunInfo(0))


def test_report_lists_and_marks_nonfinite_steps(tmp_path):
    from mindmon.analysis.report import write_report

    sink = JsonlSink(str(tmp_path))
    sink.open(RunInfo(0))
    sink.write([Record(s, None, 0, "device_loss", "loss", v) for s, v in ((1, 2.0), (2, float("nan")), (3, 1.5))]
               + [Record(3, None, 0, "grad_norm", "global", float("inf"))])
    sink.close()
    page = open(write_report(str(tmp_path), str(tmp_path / "r.html"), progress=None)).read()
    assert "Not finite (NaN/inf, marked x in the figures): device_loss at step(s) 2; grad_norm at step(s) 3" in page


def _rank_pid(rank, script):
    for pid in os.listdir("/proc"):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            command = open(f"/proc/{pid}/cmdline", "rb").read()
        except (OSError, ValueError):
            continue
        if script in command and f"RANK_ID={rank}".encode() in environ:
            return int(pid)
    return None


def test_a_killed_msrun_worker_ends_the_run_naming_it_and_keeps_the_other_ranks_steps(tmp_path):
    out = tmp_path / "out"
    demo = subprocess.Popen([sys.executable, "-m", "mindmon", "demo", "--workers", "2", "--steps", "400",
                             "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "monitor" / "rank_0" / "metrics.jsonl"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (metrics.exists() and '"step": 3,' in metrics.read_text()):
            time.sleep(0.5)
        victim = _rank_pid(1, b"mindmon/demo/worker.py")
        assert victim is not None, "rank 1's worker is running"
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        _, err = demo.communicate(timeout=240)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode != 0
    assert time.time() - killed_at < 240
    assert "mindmon demo: rank 1 was lost" in err or "mindmon demo: rank 1: ended without finishing" in err
    records = jsonl.read_records(str(metrics))
    steps = sorted({r.step for r in records if r.kind == "device_loss"})
    assert steps[:3] == [1, 2, 3]   # what rank 0 wrote before the fault is all there
    for step in steps:
        assert sum(r.kind == "device_norm" and r.step == step for r in records) == \
            sum(r.kind == "device_norm" and r.step == 1 for r in records)   # every written step is whole
