"""Shared helpers: real MindSpore, the real MindFormers 1.9.0 Trainer, the demo model.

MindFormers picks its log directory on first import, so it is pointed at a session temp dir
before anything imports it.
"""
import copy
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("LOG_MF_PATH", tempfile.mkdtemp(prefix="mindmon-test-log-"))
# A pytest-xdist worker inherits the folder its controller made above: each worker gets its own, so that
# mindformers_log() holds only the runs of the tests this process ran.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["LOG_MF_PATH"] = tempfile.mkdtemp(prefix=f"mindmon-test-log-{os.environ['PYTEST_XDIST_WORKER']}-")


def _mindformers_major():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("mindformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return None


# MindFormers 2.x imports hyper_parallel, which no package registry serves: in the environment that has
# MindFormers 2.0 (.venv-ms210), the tests' single-device stand-in goes on the path, before anything
# imports MindFormers (tests/support/hyper_parallel_standin/README.md).
HYPER_PARALLEL_STANDIN = Path(__file__).parent / "support" / "hyper_parallel_standin"
if _mindformers_major() == 2:
    sys.path.insert(0, str(HYPER_PARALLEL_STANDIN))

import mindspore as ms  # noqa: E402

# The alert tests' real servers, here so that the session-scoped ones start once per session
# (a fixture imported into several test modules would be one fixture per module).
from servers import hanging_smtp, mariadb_server, postgres_server, postgres_url, smtp_inbox  # noqa: E402,F401

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)

SMALL_MODEL = {"vocab_size": 32, "hidden_size": 16, "ffn_hidden_size": 32, "num_layers": 2,
               "num_attention_heads": 2, "seq_length": 8, "num_experts": 4, "moe_router_topk": 2,
               "first_moe_layer": 1, "mtp_num_layers": 1}


# Invalid `profiler:` sections and the key each error must name (item 1 of the profiler issue):
# the parser tests and the Trainer tests run the same list.
BAD_PROFILER_SECTIONS = [
    ({"start_step": 0, "end_step": 3}, "profiler.start_step"),
    ({"start_step": 2, "end_step": -1}, "profiler.end_step"),
    ({"start_step": 5, "end_step": 3}, "profiler.end_step"),
    ({"start_step": 5}, "profiler.end_step"),
    ({"profiler_level": "Level1"}, "profiler.profiler_level"),
    ({"profiler_level": True}, "profiler.profiler_level"),
    ({"profiler_level": 1.0}, "profiler.profiler_level"),
]


def trainer_config(output_dir, steps=2, local_batch_size=2, global_batch_size=8, monitor=None, **sections):
    """A dict config for the stock Trainer, as a user would write the YAML."""
    config = {
        "training": {"steps": steps, "local_batch_size": local_batch_size,
                     "global_batch_size": global_batch_size, "max_norm": 1.0, "seed": 7},
        "model": {"model_type": "mindmon_demo", "architectures": "DemoMoEGPT", **SMALL_MODEL},
        "optimizer": {"type": "AdamW", "weight_decay": 0.01},
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1e-2, "warmup_steps": 0},
        "train_dataset": {"dataloader": {"type": "MindDataset"}},
        "checkpoint": {"enable_save": False},
    }
    if monitor is not None:
        config["monitor"] = {"output_dir": str(output_dir), **monitor}
    config.update(sections)
    return config


def make_model():
    from mindmon.demo.model import DemoModelConfig, DemoMoEGPT

    return DemoMoEGPT(DemoModelConfig.from_dict(SMALL_MODEL))


def make_data(config):
    from mindmon.demo.data import make_dataset

    training = config["training"]
    return make_dataset(training["steps"] * training["global_batch_size"], SMALL_MODEL["seq_length"],
                        SMALL_MODEL["vocab_size"], training["global_batch_size"], seed=3)


def train(config, model=None):
    """Train through the real MindFormers Trainer; returns the trainer."""
    from mindformers.pynative.trainer import Trainer

    model = model or make_model()
    trainer = Trainer(config=copy.deepcopy(config), model=model, train_dataset=make_data(config))
    trainer.train()
    return trainer


class StepCounter:
    """A callback that tells forward hooks which step is running (global_step + 1, 1-based)."""

    def __init__(self):
        self.step = 0

    def __getattr__(self, event):
        def call(args, state, **kwargs):
            if event == "on_step_begin":
                self.step = state.global_step + 1
        return call


def count_router_choices(model, counter, topk):
    """Forward hooks on every demo `Router` cell: {(step, micro_step, layer): numpy count per expert of
    each token's top-k router scores}, layer = `decoder.layers.<L>` / `mtp.layers.<i>`. The i-th call
    of a router within a step is micro-step i."""
    from collections import defaultdict

    from mindmon.demo.model import Router

    counts, calls = {}, defaultdict(int)

    def hook(layer):
        def on_forward(cell, inputs, scores):
            scores = scores.asnumpy()
            chosen = np.argsort(-scores, axis=1)[:, :topk]
            micro_step = calls[(counter.step, layer)]
            calls[(counter.step, layer)] += 1
            counts[(counter.step, micro_step, layer)] = np.bincount(chosen.ravel(), minlength=scores.shape[1])
        return on_forward

    for name, cell in model.cells_and_names():
        if isinstance(cell, Router):
            cell.register_forward_hook(hook(re.match(r"(decoder|mtp)\.layers\.\d+", name).group(0)))
    return counts


def mindformers_log():
    """The MindFormers log of this test session (every test appends to it)."""
    return (Path(os.environ["LOG_MF_PATH"]) / "rank_0" / "info.log").read_text()


def read_jsonl(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture
def rng():
    return np.random.default_rng(0)


VIEW_DEMO_STEPS = 4
# The shipped scenario: TensorBoard sink, tokens per expert every micro-step, MaxLogitsMonitor,
# over configs/demo.yaml's train_state (filtered local_norm, local_loss, device_norm, device_loss).
VIEW_DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tensorboard.yaml"


@pytest.fixture(scope="session")
def view_demo(tmp_path_factory):
    """`mindmon demo --config configs/tensorboard.yaml`: every monitor, the MaxLogitsMonitor callback
    and the TensorBoard sink on (a subprocess, as a user runs it); returns its --output directory.
    Shared by the TensorBoard, parse-log and report tests."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("view_demo")
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "demo", "--steps", str(VIEW_DEMO_STEPS),
                             "--output", str(out), "--config", str(VIEW_DEMO_CONFIG)],
                            capture_output=True, text=True, env=env, cwd=out, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out
