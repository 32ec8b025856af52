"""One rank of kj600's cc_distribution test (test_collectives_kj600.py), started by msrun with two workers on
CPU (mccl).

Phase 1 (statistics): kj600's recipe, `hook_modules(model, 1)` and then `set_wrapped_optimizer(optimizer)`,
with cc_distribution {enable, cc_pre_hook}: each step the rank all-reduces its two gradients, then its loss
from another line (the function's third call of the step); the statistics go to kj600's TensorBoard, every
output norm to the anomaly dump. Every tensor sent is saved to sent_rank<r>.npz for the test's numpy check.
Phase 2 (cc_log_only): `hook_modules` alone, no optimizer given to the monitor: the calls are logged and
training stops at the first forward of the second step, the collectives restored.
"""
import json
import os
import sys

import numpy as np

import mindspore as ms
from mindspore import nn, ops, value_and_grad
from mindspore.communication import get_rank, init

from mindmon.features.collectives.hooks import CollectivesLogged
from mindmon.kj600.module_hook import TrainerMon

STEPS = 2


def patched() -> bool:
    return "__call__" in vars(ops.AllReduce)


def train(config, rank, steps, out_dir, give_optimizer):
    os.environ["KJ600_OUTPUT_DIR"] = out_dir
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir   # the anomaly dump's root (anomaly_detected/rank<r>/)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "config.json")
    with open(path, "w") as handle:
        json.dump(config, handle)
    ms.set_seed(0)
    model = nn.Dense(4, 3)
    model.set_train(True)
    monitor = TrainerMon(path, params_have_main_grad=False)
    monitor.hook_modules(model, 1)                       # kj600's README: the model first ...
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)
    if give_optimizer:
        TrainerMon.set_wrapped_optimizer(optimizer)      # ... the optimizer once it exists
    all_reduce = ops.AllReduce()
    grad_fn = value_and_grad(lambda x: (model(x) ** 2).mean(), None, optimizer.parameters)
    loss_reduce = ops.AllReduce()
    rng = np.random.default_rng(10 + rank)
    sent = []
    try:
        for step in range(steps):
            train.step = step
            loss, grads = grad_fn(ms.Tensor(rng.standard_normal((5, 4)).astype(np.float32)))
            sent.append([g.asnumpy().copy() for g in grads] + [loss.asnumpy().copy()])
            reduced = [all_reduce(g) for g in grads]
            loss_reduce(loss)                            # another call site of AllReduce
            train.patched_in_step = patched()
            optimizer(tuple(r / 2 for r in reduced))
    finally:
        monitor.close()
    return sent


def main():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank = get_rank()
    base = sys.argv[1]
    # every output norm above 0 is an anomaly: the dump names each call by msprobe's tag name
    rule = {"rule_name": "AnomalyNan", "args": {"threshold": 0.0}, "kinds": ["cc_post"], "statistics": ["norm"]}
    config = {"cc_distribution": {"enable": True, "cc_pre_hook": True}, "ops": ["min", "max", "mean", "norm"],
              "alert": {"rules": [rule], "dump": True}}
    sent = train(config, rank, STEPS, os.path.join(base, "stats"), give_optimizer=True)
    np.savez(os.path.join(base, f"sent_rank{rank}.npz"),
             **{f"{s}_grad{i}": g for s, grads in enumerate(sent) for i, g in enumerate(grads[:2])},
             **{f"{s}_loss": tensors[2] for s, tensors in enumerate(sent)})
    print(f"patched in training: {train.patched_in_step}; after close: {patched()}", flush=True)
    try:
        train({"cc_distribution": {"enable": True, "cc_log_only": True}}, rank, 5, os.path.join(base, "log_only"),
              give_optimizer=False)
    except CollectivesLogged as stop:
        print(f"stopped: code {stop.code} at step {train.step}; patched: {patched()}", flush=True)


if __name__ == "__main__":
    main()
