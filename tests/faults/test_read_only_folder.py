"""The output folder turns read-only mid-run, for real: the job (tests/support/scripts/every_sink_job.py:
msprobe's CSV, the JSONL, the Arrow stream / Parquet file, TensorBoard, the alert dump and the
alert spool) runs in its own mount namespace (`unshare -m`) on a bind mount of its folder; after
step PAUSE the test replaces that mount, from outside (`nsenter`), by a read-only bind mount of the
same folder (the old mount is detached lazily: a remount to read-only is refused while files are
open for writing). Every open or rename from then on fails with EROFS; files a sink already holds
open stay writable through it, as on a remount whose writers keep their handles. Each sink that
fails logs it once, training runs to the end, the code after training runs, and every file holds
what the same run writes without the fault: all of it, or exactly its steps up to PAUSE."""
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mindmon.formats import columnar, jsonl
from mindmon.formats.msprobe_csv import read_csv
from tests.support.servers import free_port
from tests.faults.test_full_disk import _by_step, _csv_files, _scalars
from tests.support import HERE

JOB = Path(HERE) / "scripts" / "every_sink_job.py"
STEPS, PAUSE = 30, 12
EROFS = "[Errno 30] Read-only file system"


def _job(output_dir, dead_url, pause=0):
    output_dir.mkdir()
    return [sys.executable, str(JOB), str(output_dir), str(STEPS), "0", str(pause), dead_url]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.fail("util-linux's unshare and nsenter are needed")
    root, dead_url = tmp_path_factory.mktemp("read_only"), f"mysql+pymysql://u:pw@127.0.0.1:{free_port()}/db"
    free = subprocess.Popen(_job(root / "free", dead_url), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder = root / "ro"
    command = ["unshare", "-m", "--propagation", "private", "sh", "-c",
               'mount --bind "$0" "$0" && exec "$@"', str(folder)] + _job(folder, dead_url, PAUSE)
    job = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    while not lines or lines[-1] != f"step {PAUSE}":
        line = job.stdout.readline()
        assert line, job.stderr.read()[-3000:]
        lines.append(line.strip())
    swap = 'umount -l "$0" && mount --bind "$0" "$0" && mount -o remount,bind,ro "$0"'
    subprocess.run(["nsenter", "-t", str(job.pid), "-m", "sh", "-c", swap, str(folder)], check=True)
    job.stdin.write("\n")
    job.stdin.flush()
    out, err = job.communicate(timeout=600)
    free_out, free_err = free.communicate(timeout=600)
    for code, stdout, stderr in ((job.returncode, out, err), (free.returncode, free_out, free_err)):
        assert code == 0, stderr[-3000:]
        assert stdout.splitlines()[-2:] == [f"step {STEPS}", "after train"]   # training went on; the code after it ran
        assert "Traceback" not in stderr and "Exception in thread" not in stderr
    print("\n[read-only] the job's error lines:\n" + "\n".join(l for l in err.splitlines() if "ERROR" in l))
    return root / "free", folder, err


def _whole_up_to_pause_or_all(full, free):
    """`full` is `free` whole (the sink kept its open file), or `free` cut after step PAUSE."""
    assert sorted(full) in (sorted(free), list(range(1, PAUSE + 1)))
    for step in full:
        assert full[step] == free[step], step
    return max(full)


def test_the_dump_and_the_spool_report_once_and_keep_every_step_before_the_fault(runs):
    free, ro, stderr = runs
    assert stderr.count(f"writing {ro}/monitor/anomaly_detected/rank0/anomaly.json failed ({EROFS}") == 1
    assert stderr.count("spool write failed (Read-only file system); anomalies are dropped from delivery") == 1
    dumps = [json.loads((run / "monitor/anomaly_detected/rank0/anomaly.json").read_text()) for run in (free, ro)]
    per_step = [Counter(entry["step"] for entry in dump.values()) for dump in dumps]
    assert sorted(per_step[1]) == list(range(1, PAUSE + 1))     # the steps before the fault, each whole
    assert all(per_step[1][step] == per_step[0][step] > 0 for step in per_step[1])
    assert {key: entry for key, entry in dumps[0].items() if entry["step"] <= PAUSE} == dumps[1]
    spool = ro / "monitor/anomaly_detected/rank0/spool"
    (spooled,) = spool.glob("*.jsonl")
    lines = spooled.read_text().splitlines(keepends=True)
    assert lines and all(line.endswith("\n") for line in lines)
    steps = Counter(json.loads(line)["anomaly"]["step"] for line in lines)
    assert sorted(steps) == list(range(1, PAUSE + 1))           # what was spooled before the fault stays, whole
    assert sum(steps.values()) == sum(per_step[1].values()) - 1  # all but the one held in memory (queue_size 1)


def test_the_jsonl_csv_stream_and_tensorboard_keep_what_they_wrote_and_training_goes_on(runs):
    free, ro, stderr = runs
    path = "monitor/rank_0/metrics.jsonl"
    lasts = {"jsonl": _whole_up_to_pause_or_all(_by_step(jsonl.read_records(str(ro / path))),
                                                 _by_step(jsonl.read_records(str(free / path))))}
    for name, csv_path in _csv_files(ro).items():
        lasts[name] = _whole_up_to_pause_or_all(_by_step(read_csv(csv_path)), _by_step(read_csv(_csv_files(free)[name])))
    (_, stream), = columnar.columnar_files(str(ro / "monitor" / "rank_0"))
    free_records = columnar.read_records(str(free / "monitor" / "rank_0" / "metrics.parquet"))
    lasts["arrow"] = _whole_up_to_pause_or_all(_by_step(columnar.read_records(stream)), _by_step(free_records))
    lasts["tensorboard"] = _whole_up_to_pause_or_all(_scalars(ro / "tensorboard" / "rank_0"),
                                                     _scalars(free / "tensorboard" / "rank_0"))
    print(f"[read-only] last step in each file: {lasts}")
    assert len(_csv_files(ro)) == len(_csv_files(free)) == 4
    csv_cut = {last for name, last in lasts.items() if name.endswith(".csv")}
    for sink, cut in (("JsonlSink", lasts["jsonl"] == PAUSE), ("MsprobeCsvSink", csv_cut == {PAUSE}),
                      ("TensorBoardSink", lasts["tensorboard"] == PAUSE), ("ColumnarSink", lasts["arrow"] == PAUSE)):
        assert stderr.count(f"mindmon: {sink} failed (OSError: {EROFS}") == int(cut), sink   # once when it failed
    # the stream was kept open and is whole; the Parquet file made at close is refused, once, the stream kept
    assert stderr.count("mindmon: ColumnarSink: compacting metrics.arrows into metrics.parquet failed") == 1
    assert sum(lasts[name] == PAUSE for name in lasts) >= 4   # the sinks that open files per write stopped there
