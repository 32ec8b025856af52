"""One rank of test_collectives_msprobe.py, started by msrun with two workers on CPU (mccl).

    python msprobe_cc_worker.py OUT_DIR

Two runs of the same loop (a small attention model, STEPS steps; each step the rank all-reduces its four
gradients and a "metric" and all-gathers a small tensor):

- `v2`: msprobe's monitor_v2 (`TrainerMonitorV2`) with `monitors.cc` (cc_pre_hook; cc_codeline = the lines
  of `exchange`, so the metric's AllReduce is left out); files under OUT_DIR/v2/rank_<r>/.
- `v1`: msprobe's `TrainerMon` with cc_distribution (cc_pre_hook, every call), the tensor statistics and the
  L2 features, from step 1 on (step 0's calls are made but not collected), msprobe's CSV under
  OUT_DIR/v1/ and msprobe's TensorBoard under OUT_DIR/v1_tb/.

Every tensor a rank sends is saved to OUT_DIR/<run>_sent_rank<r>.npz for the test's numpy check.
"""
import inspect
import json
import os
import sys

import numpy as np

import mindspore as ms
from mindspore import nn, ops, value_and_grad
from mindspore.communication import get_rank, init

from mindmon.msprobe import TrainerMon, TrainerMonitorV2
from mindmon.sinks.tensorboard import msprobe_tensorboard_sink
from tests.features.l2.test_l2_trainer_mon import BATCH, HIDDEN, SEQ, Net

STEPS = 3
OPS = ["min", "max", "mean", "norm", "nans"]


def exchange(grads, small):
    reduced = [ALL_REDUCE(g) for g in grads]                       # exchange: gradients
    gathered = ALL_GATHER(small)                                   # exchange: small
    return reduced, gathered


def sync_metric(value):
    return ALL_REDUCE(value)                                       # metric


def exchange_lines():
    lines, first = inspect.getsourcelines(exchange)
    return [f"msprobe_cc_worker\\.py\\[{first + i}\\]" for i, text in enumerate(lines) if "# exchange" in text]


def write_config(base, name, config):
    path = os.path.join(base, f"{name}_config_rank{get_rank()}.json")   # one per rank: no race
    with open(path, "w") as handle:
        json.dump(config, handle)
    return path


def train(run, base, rank):
    ms.set_seed(0)
    model = Net()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)
    if run == "v2":
        config = {"framework": "mindspore", "output_dir": os.path.join(base, "v2"), "step_count_per_record": STEPS,
                  "monitors": {"module": {"enabled": False},
                               "cc": {"enabled": True, "cc_pre_hook": True, "cc_codeline": exchange_lines(),
                                      "ops": OPS}}}
        monitor = TrainerMonitorV2(write_config(base, run, config), fr="mindspore")
        monitor.start(model=model, optimizer=optimizer)
    else:
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(base, "v1")
        config = {"cc_distribution": {"enable": True, "cc_pre_hook": True}, "start_step": 1, "ops": OPS,
                  "wg_distribution": True, "param_distribution": True, "xy_distribution": True,
                  "l2_targets": {"attention_hook": ["core"], "linear_hook": []}, "recording_l2_features": True,
                  "sa_order": "b,s,h,d"}
        monitor = TrainerMon(write_config(base, run, config), params_have_main_grad=False,
                             extra_sinks=[msprobe_tensorboard_sink(os.path.join(base, "v1_tb"))])
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    grad_fn = value_and_grad(lambda x: (model(x) ** 2).mean(), None, optimizer.parameters)
    rng = np.random.default_rng(10 + rank)
    sent = {}
    for step in range(STEPS):
        _, grads = grad_fn(ms.Tensor(rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32)))
        small = ms.Tensor((rng.standard_normal((2, 3)) * (rank + 1)).astype(np.float32))
        metric = ms.Tensor(np.float32(step + 0.5 * rank))
        sent.update({f"{step}_grad{i}": g.asnumpy().copy() for i, g in enumerate(grads)})
        sent[f"{step}_small"], sent[f"{step}_metric"] = small.asnumpy().copy(), metric.asnumpy().copy()
        reduced, _ = exchange(grads, small)
        sync_metric(metric)
        optimizer(tuple(r / 2 for r in reduced))
        if run == "v2":
            monitor.step()
    if run == "v2":
        monitor.stop()
    else:
        monitor.close()
    np.savez(os.path.join(base, f"{run}_sent_rank{rank}.npz"), **sent)


def main():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank = get_rank()
    global ALL_REDUCE, ALL_GATHER
    ALL_REDUCE, ALL_GATHER = ops.AllReduce(), ops.AllGather()
    for run in ("v2", "v1"):
        train(run, sys.argv[1], rank)
        print(f"{run} done; patched after close: {'__call__' in vars(ops.AllReduce)}", flush=True)


if __name__ == "__main__":
    main()
