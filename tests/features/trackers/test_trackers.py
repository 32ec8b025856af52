"""monitor.trackers with the real trackers: a real MLflow tracking server (SQLite store) read back through
MLflow's client, SwanLab's offline file read by SwanLab's own reader, W&B's offline file decoded with W&B's
own record schema; each one broken mid-run while the plain loop trains on. Values are checked against the
JSONL records the same run wrote, and the losses against numpy."""
import glob
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from mindspore import Tensor, nn

from tests.support.jsonl import read_jsonl
from tests.support.servers import free_port
from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
from tests.support.scripts.plain_loop_job import Regression

K, BATCH, LR = 2, 8, 0.1
FAILED = "failed ("   # MonitorGroup's one line for a sink it switches off


def _data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(BATCH, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype(np.float32)
    return x, y


def numpy_losses(steps):
    """The step losses of Regression under SGD(lr) with K micro-batches, in float64."""
    x, y = (a.astype(np.float64) for a in _data())
    w, b, losses = np.full((3, 1), 0.5), np.zeros(1), []
    for _ in range(steps):
        grad_w, grad_b, micro = np.zeros_like(w), np.zeros_like(b), []
        for xs, ys in zip(np.split(x, K), np.split(y, K)):
            diff = xs @ w + b - ys
            micro.append(np.mean(diff ** 2))
            grad_w += xs.T @ diff * 2 / diff.size / K
            grad_b += np.sum(diff, axis=0) * 2 / diff.size / K
        losses.append(np.mean(micro))
        w, b = w - LR * grad_w, b - LR * grad_b
    return losses


def train(output_dir, trackers, steps=4, alert=False, before_step=None):
    """The plain loop with monitor.train_state and monitor.speed on; `before_step(step, group)` runs first."""
    monitor = {"output_dir": str(output_dir), "speed": {"enabled": True}, "trackers": trackers,
               "train_state": {"local_loss": True, "device_loss": True, "device_norm": "weight"}}
    if alert:   # every finite |x| > 1e-9 is an anomaly: a dump with many entries to count
        monitor["alert"] = {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1.0e-9}}], "dump": True}
    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=LR)
    group = build_group(parse_sections({"monitor": monitor}), parameter_names=[p.name for p in optimizer.parameters],
                        global_batch_size=BATCH)
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=K, group=group, max_norm=0.0)
    group.setup(global_batch_size=BATCH, max_steps=steps)
    x, y = _data()
    for step in range(1, steps + 1):
        if before_step is not None:
            before_step(step, group)
        loss, grad_norm = train_step(split_batch((Tensor(x), Tensor(y)), K))
        group.flush(step, loss=loss, grad_norm=grad_norm, learning_rate=LR)
    return group


def recorded(output_dir):
    """{step: {tag: value}} of the run's JSONL for the tags checked here (their TensorBoard names)."""
    tags = {("loss", "loss"): "lm_loss", ("grad_norm", "global"): "grad-norm", ("device_loss", "loss"): "device_loss",
            ("device_norm", "layer.weight"): "device_norm/layer.weight", ("learning_rate", "lr"): "learning-rate"}
    out = {}
    for r in read_jsonl(os.path.join(output_dir, "rank_0", "metrics.jsonl")):
        if r["micro_step"] is None and (r["kind"], r["name"]) in tags:
            out.setdefault(r["step"], {})[tags[(r["kind"], r["name"])]] = r["value"]
    return out


def assert_matches_run(got, output_dir, steps):
    """`got` {step: {tag: value}} from a tracker holds the JSONL's values, and the losses are numpy's."""
    expected = recorded(output_dir)
    assert sorted(expected) == list(range(1, steps + 1))
    for step, values in expected.items():
        for tag, value in values.items():
            assert got[step][tag] == pytest.approx(value, rel=1e-6), (step, tag)
    for step, loss in enumerate(numpy_losses(steps), start=1):
        assert got[step]["device_loss"] == pytest.approx(loss, rel=1e-5)
        assert got[step]["lm_loss"] == pytest.approx(loss, rel=1e-5)


def wait_until(condition, seconds=60.0, what="condition"):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {seconds:.0f} s for {what}")
        time.sleep(0.1)


def tracker_sink(group, name):
    return next(s for s in group.sinks if getattr(s, "NAME", None) == name)


def failure_lines(caplog, sink_class):
    return [r.getMessage() for r in caplog.records if sink_class in r.getMessage() and FAILED in r.getMessage()]


# MLflow ------------------------------------------------------------------------------------------------------------

class MlflowServer:
    """`mlflow server` on a free localhost port with a SQLite store and a local artifact folder (gunicorn and
    one worker: the quickest start)."""

    def __init__(self, folder):
        self.folder, self.port = str(folder), free_port()
        self.store = f"sqlite:///{folder}/mlflow.db"
        self.uri = f"http://127.0.0.1:{self.port}"
        mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
        self.log = open(os.path.join(folder, "server.log"), "w")
        self.process = subprocess.Popen(
            [mlflow, "server", "--backend-store-uri", self.store, "--artifacts-destination", f"{folder}/artifacts",
             "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1", "--gunicorn-opts", "--timeout 60"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self.healthy, 150, f"the MLflow server (log: {folder}/server.log)")

    def healthy(self):
        assert self.process.poll() is None, open(os.path.join(self.folder, "server.log")).read()[-2000:]
        try:
            return urllib.request.urlopen(f"{self.uri}/health", timeout=2).status == 200
        except OSError:
            return False

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)   # its gunicorn workers too
            self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def _mlflow_run(client, experiment):
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def test_mlflow_gets_metrics_params_and_artifacts(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    output = tmp_path / "out"
    # close_timeout: the report is made at close, slow on a busy machine
    group = train(output, {"mlflow": {"tracking_uri": mlflow_server.uri, "experiment": "values",
                                      "run_name": "plain-loop", "close_timeout": 150}}, steps=4, alert=True)
    group.close()
    client = MlflowClient(mlflow_server.uri)
    run = _mlflow_run(client, "values")
    assert run.info.run_name == "plain-loop" and run.info.status == "FINISHED"
    got = {}
    for tag in ("lm_loss", "grad-norm", "device_loss", "device_norm/layer.weight", "learning-rate"):
        for metric in client.get_metric_history(run.info.run_id, tag):
            got.setdefault(metric.step, {})[tag] = metric.value
    assert_matches_run(got, output, 4)
    # speed's step time arrives under its TensorBoard tag, one value per step
    assert [m.step for m in client.get_metric_history(run.info.run_id, "step_time/step")] == [1, 2, 3, 4]
    params = run.data.params
    assert params["monitor.train_state.device_norm"] == "['weight']" and params["monitor.output_dir"] == str(output)
    assert params["monitor.trackers.mlflow.run_name"] == "plain-loop"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"report.html", "anomaly_detected"}
    downloaded = client.download_artifacts(run.info.run_id, "anomaly_detected/rank0/anomaly.json", str(tmp_path))
    with open(output / "anomaly_detected" / "rank0" / "anomaly.json") as mine, open(downloaded) as theirs:
        dump = json.load(mine)
        assert json.load(theirs) == dump and len(dump) > 4
    report = client.download_artifacts(run.info.run_id, "report.html", str(tmp_path / "r"))
    assert "mindmon report" in open(report).read()


def test_mlflow_server_killed_mid_run_training_goes_on(mlflow_server, tmp_path, caplog, monkeypatch):
    """Last of the MLflow tests: it kills the module's server after step 3."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")   # a refused connection fails at once
    output = tmp_path / "out"

    def kill_after_three(step, group):
        if step == 4:
            sink = tracker_sink(group, "MLflow")
            wait_until(lambda: sink.delivered_steps == 3, what="MLflow to have steps 1-3")
            mlflow_server.stop()

    with caplog.at_level(logging.INFO, logger="mindmon"):
        group = train(output, {"mlflow": {"tracking_uri": mlflow_server.uri, "experiment": "killed"}}, steps=8,
                      before_step=kill_after_three)
        sink = tracker_sink(group, "MLflow") if any(getattr(s, "NAME", "") == "MLflow" for s in group.sinks) else None
        group.close()
    assert sorted(recorded(output)) == list(range(1, 9))   # training went on: every step in the JSONL
    lines = failure_lines(caplog, "MlflowSink")
    assert len(lines) == 1 and "MLflow" in lines[0], lines
    assert sink is None   # switched off by the group, before the end of the run
    # what reached the server before it died stays in its store, read with MLflow's client
    store = MlflowClient(mlflow_server.store)
    run = _mlflow_run(store, "killed")
    assert [m.step for m in store.get_metric_history(run.info.run_id, "lm_loss")] == [1, 2, 3]


# SwanLab -----------------------------------------------------------------------------------------------------------

def swanlab_scalars(log_dir):
    """{step: {key: value}} from the run's .swanlab file, read by SwanLab's DataStoreReader."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    [path] = glob.glob(os.path.join(log_dir, "run-*", "run-*.swanlab"))
    reader, out = DataStoreReader(), {}
    reader.open(path)
    for raw in reader:
        record = Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "scalar":
            out.setdefault(record.scalar.step, {})[record.scalar.key] = record.scalar.value.number
    reader.close()
    return out


def test_swanlab_offline_file_holds_the_run(tmp_path):
    output = tmp_path / "out"
    train(output, {"swanlab": {"project": "values", "experiment": "plain-loop"}}, steps=4).close()
    assert_matches_run(swanlab_scalars(output / "swanlog"), output, 4)


def test_swanlab_unwritable_log_dir_training_goes_on(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where SwanLab's folder should go")
    output = tmp_path / "out"
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        train(output, {"swanlab": {"log_dir": str(blocker / "swanlog")}}, steps=4).close()
    assert sorted(recorded(output)) == [1, 2, 3, 4]
    lines = failure_lines(caplog, "SwanlabSink")
    assert len(lines) == 1 and "SwanLab" in lines[0], lines


def test_swanlab_disk_full_mid_run_training_goes_on(tmp_path):
    """SwanLab's folder on a 64 KiB tmpfs that fills mid-run: SwanLab's writes fail (it logs them itself and
    raises nothing), training goes on with every step in the JSONL, and the steps SwanLab wrote before the
    disk filled are in its file with the run's values."""
    import subprocess

    folder = tmp_path / "swanlog"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], check=True)
    try:
        output = tmp_path / "out"
        train(output, {"swanlab": {"log_dir": str(folder)}}, steps=60).close()
        assert sorted(recorded(output)) == list(range(1, 61))
        got = swanlab_scalars(folder)
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
    written = sorted(step for step, values in got.items() if "lm_loss" in values)
    assert written and written == list(range(1, written[-1] + 1)) and written[-1] < 60   # the disk filled mid-run
    expected = recorded(output)
    for step in written:
        assert got[step]["lm_loss"] == pytest.approx(expected[step]["lm_loss"], rel=1e-6)


# W&B ---------------------------------------------------------------------------------------------------------------

def _leveldb_records(data):
    """The records of a W&B datastore: a 7-byte file header, then LevelDB log blocks of 32 KiB (each chunk:
    crc32, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def wandb_history(directory):
    """{step: {key: value}} of the offline run's history records, decoded with W&B's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(os.path.join(directory, "wandb", "offline-run-*", "run-*.wandb"))
    out = {}
    with open(path, "rb") as f:
        for raw in _leveldb_records(f.read()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                out.setdefault(record.history.step.num, {}).update(items)
    return out


@pytest.fixture
def quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")


def test_wandb_offline_run_holds_the_run(tmp_path, quiet_wandb):
    output = tmp_path / "out"
    train(output, {"wandb": {"project": "values", "run_name": "plain-loop"}}, steps=4).close()
    history = wandb_history(output)
    assert_matches_run(history, output, 4)
    assert all(history[step]["_step"] == step for step in range(1, 5))


def test_wandb_service_killed_mid_run_training_goes_on(tmp_path, quiet_wandb, caplog):
    import psutil

    output = tmp_path / "out"

    def kill_service(step, group):
        if step == 3:
            sink = tracker_sink(group, "W&B")
            wait_until(lambda: sink.delivered_steps == 2, what="W&B to have steps 1-2")
            services = [p for p in psutil.Process().children(recursive=True) if "wandb-core" in p.name()]
            assert services, "no wandb-core process to stop"
            for process in services:
                process.kill()

    with caplog.at_level(logging.ERROR, logger="mindmon"):
        group = train(output, {"wandb": {"close_timeout": 20}}, steps=8, before_step=kill_service)
        group.close()
    assert sorted(recorded(output)) == list(range(1, 9))
    lines = failure_lines(caplog, "WandbSink") + [r.getMessage() for r in caplog.records
                                                   if "W&B did not finish" in r.getMessage()]
    assert len(lines) == 1, lines
    # W&B's service buffers its file: killed, it may not have written steps 1-2; it never has a later one
    history = wandb_history(output)
    assert set(history) <= {1, 2}
    for step, values in history.items():
        assert values["lm_loss"] == pytest.approx(numpy_losses(step)[-1], rel=1e-5)
