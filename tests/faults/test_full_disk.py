"""A full disk (RLIMIT_FSIZE in a subprocess: no file may grow past LIMIT bytes) while msprobe's CSV, the
JSONL, the Arrow stream / Parquet file and TensorBoard are written at once. Each sink's failure is logged
once and switches that sink off; the others go on, training goes on, and every file, read back with its
own reader, holds exactly what the same run writes without the limit up to its last whole step.
(The alert dump and spool: tests/features/alerts/test_alerts_outages.py::test_a_full_disk_keeps_the_dump_and_the_spool_whole.)"""
import glob
import logging
import os
import re
import resource
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mindmon.core.engine import RunInfo
from mindmon.formats import columnar, jsonl
from mindmon.formats.msprobe_csv import read_csv
from mindmon.core.records import Record
from mindmon.sinks.columnar import ColumnarSink
from tests.support import HERE

JOB = Path(HERE) / "scripts" / "every_sink_job.py"
STEPS = 70
LIMIT = 24_000   # JSONL and TensorBoard (~4 KB a step) hit it first, the stream next, the CSV files (~0.4 KB) last


def _run(output_dir, *limit):
    output_dir.mkdir()
    return subprocess.run([sys.executable, str(JOB), str(output_dir), str(STEPS), *map(str, limit)],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_disk")
    with ThreadPoolExecutor(2) as pool:
        free, full = pool.map(lambda args: _run(*args), [(root / "free",), (root / "full", LIMIT)])
    for job in (free, full):
        assert job.returncode == 0, job.stderr[-3000:]
        assert job.stdout.splitlines()[-2:] == [f"step {STEPS}", "after train"]   # training went on to the end
        assert "Traceback" not in job.stderr and "Exception in thread" not in job.stderr
    return root / "free", root / "full", full.stderr


def _by_step(records):
    steps = {}
    for record in records:
        steps.setdefault(record.step, []).append(record)
    return steps


def _assert_whole_prefix(full, free):
    """`full` (step -> records) is `free` cut after its last step: every step before it whole, nothing after."""
    last = max(full)
    assert 2 <= last < STEPS, f"the limit was hit at step {last}"
    assert sorted(full) == list(range(1, last + 1))
    for step in full:
        assert full[step] == free[step], step
    return last


def _failure_logged_once(stderr, sink):
    assert stderr.count(f"mindmon: {sink} failed (OSError: [Errno 27] File too large)") == 1


def _csv_files(run_dir):
    return {os.path.basename(path): path for path in glob.glob(str(run_dir / "csv" / "*-rank0-*" / "*.csv"))}


def _last_jsonl_step(run_dir):
    return max(r.step for r in jsonl.read_records(str(run_dir / "monitor" / "rank_0" / "metrics.jsonl")))


def test_jsonl_keeps_every_whole_step(runs):
    free, full, stderr = runs
    _failure_logged_once(stderr, "JsonlSink")
    path = "monitor/rank_0/metrics.jsonl"
    assert (full / path).read_text().endswith("\n")   # no cut line
    _assert_whole_prefix(_by_step(jsonl.read_records(str(full / path))), _by_step(jsonl.read_records(str(free / path))))


def test_csv_keeps_every_whole_row_and_goes_on_after_the_other_sinks_failed(runs):
    free, full, stderr = runs
    _failure_logged_once(stderr, "MsprobeCsvSink")
    full_files, free_files = _csv_files(full), _csv_files(free)
    assert sorted(full_files) == sorted(free_files) == [
        "grad_reduced_0-999.csv", "grad_unreduced_0-999.csv", "param_origin_0-999.csv", "param_updated_0-999.csv"]
    lasts = []
    for name, path in full_files.items():
        assert open(path, newline="").read().endswith("\r\n")   # no half row
        lasts.append(_assert_whole_prefix(_by_step(read_csv(path)), _by_step(read_csv(free_files[name]))))
    assert min(lasts) > _last_jsonl_step(full) + 10   # the CSV went on long after the JSONL sink was switched off


def test_parquet_stream_keeps_every_whole_step(runs):
    free, full, stderr = runs
    _failure_logged_once(stderr, "ColumnarSink")
    folder = full / "monitor" / "rank_0"
    assert not list(folder.glob("*.partial"))
    # Compacted at close (the Parquet file fits), else the stream is kept: either is read by the same reader.
    (rank, path), = columnar.columnar_files(str(folder))
    free_records = columnar.read_records(str(free / "monitor" / "rank_0" / "metrics.parquet"))
    last = _assert_whole_prefix(_by_step(columnar.read_records(path)), _by_step(free_records))
    assert last > _last_jsonl_step(full)   # it went on after the JSONL sink failed


def _scalars(event_dir):
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    accumulator = EventAccumulator(str(event_dir), size_guidance={SCALARS: 0})
    accumulator.Reload()
    steps = {}
    for tag in accumulator.Tags()["scalars"]:
        for event in accumulator.Scalars(tag):
            steps.setdefault(event.step, []).append((tag, event.value))
    return {step: sorted(values) for step, values in steps.items()}


def test_tensorboard_keeps_every_whole_step(runs):
    free, full, stderr = runs
    _failure_logged_once(stderr, "TensorBoardSink")
    full_scalars, free_scalars = _scalars(full / "tensorboard" / "rank_0"), _scalars(free / "tensorboard" / "rank_0")
    assert len(free_scalars[1]) == 4 * 4 * 4   # 4 points x 4 parameters x 4 ops
    _assert_whole_prefix(full_scalars, free_scalars)


def test_a_parquet_compaction_that_fails_leaves_the_stream_readable(tmp_path, caplog):
    """The stream of 50 steps fits; the Parquet file made at close does not (RLIMIT_FSIZE set in this
    process for the close only): the stream stays, whole, no partial file is left, the lock is released."""
    output = tmp_path / "monitor"
    sink = ColumnarSink(str(output))
    sink.open(RunInfo(0))
    written = []
    for step in range(1, 51):
        records = [Record(step, None, 0, "device_norm", f"p{i}", step * 0.5 + i) for i in range(30)]
        sink.write(records)
        sink.flush()
        written += records
    folder = output / "rank_0"
    stream_size = os.path.getsize(folder / columnar.STREAM_FILE)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
    try:
        with caplog.at_level(logging.ERROR, logger="mindmon"), pytest.raises(OSError, match="File too large"):
            sink.close()   # the stream's end marker no longer fits either
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    message, = [r.getMessage() for r in caplog.records]   # logged once
    assert re.fullmatch(r"mindmon: ColumnarSink: compacting metrics\.arrows into metrics\.parquet failed \(.*File too "
                        r"large\); the stream is kept, readable up to its last whole step: `mindmon compact "
                        + re.escape(str(output)) + "` makes the Parquet file later", message), message
    assert sorted(os.listdir(folder)) == [columnar.STREAM_FILE]   # no Parquet, no .partial, no run.lock
    assert os.path.getsize(folder / columnar.STREAM_FILE) == stream_size
    assert columnar.read_records(str(folder / columnar.STREAM_FILE)) == written
