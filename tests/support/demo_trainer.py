"""The demo model and the stock MindFormers Trainer as the tests drive them: the small model's sizes, a
user's config as a dict, training through the real Trainer, forward-hook counters."""
import copy
import os
import re
from pathlib import Path

import mindspore as ms
import numpy as np

# Synchronous PyNative, as tests/conftest.py sets it for the test processes: the workers that import this
# module (msrun ranks, the MindFormers runs) get it too. Asynchronous, a small CPU machine's steps are several
# times slower (docs/performance.md), which the hang test's derived hang_after must not be.
ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)

SMALL_MODEL = {"vocab_size": 32, "hidden_size": 16, "ffn_hidden_size": 32, "num_layers": 2,
               "num_attention_heads": 2, "seq_length": 8, "num_experts": 4, "moe_router_topk": 2,
               "first_moe_layer": 1, "mtp_num_layers": 1}


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


VIEW_DEMO_STEPS = 4


# The shipped scenario: TensorBoard sink, tokens per expert every micro-step, MaxLogitsMonitor,
# over configs/demo.yaml's train_state (filtered local_norm, local_loss, device_norm, device_loss).
VIEW_DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tensorboard.yaml"
