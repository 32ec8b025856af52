"""One rank of the cc_distribution test (test_collectives.py), started by msrun with two workers on CPU.

Phase 1 (statistics): TrainerMon with cc_distribution {enable, cc_pre_hook, cc_codeline = the two lines in
`exchange`}; each step the rank all-reduces its gradients, all-gathers and broadcasts a small tensor (taken)
and all-reduces a "metric" from `sync_metric` (left out by cc_codeline). Every tensor sent is saved to
sent_rank<r>.npz for the test's numpy check. (comm_func.all_reduce is not called: on CPU its kernel fails
asynchronously and breaks the next MindSpore op of the process; ops.ReduceScatter has no CPU kernel.)
Phase 2 (cc_log_only): the calls are logged, training stops before the second optimizer step, the
collectives are restored.
"""
import inspect
import json
import os
import sys

import numpy as np

import mindspore as ms
from mindspore import nn, ops, value_and_grad
from mindspore.communication import get_rank, init

from mindmon.msprobe import TrainerMon
from mindmon.features.collectives.hooks import CollectivesLogged

STEPS = 2


def exchange(grads, small, sent):
    reduced = [ALL_REDUCE(g) for g in grads]                       # taken: cc_codeline line 1
    gathered, cast = ALL_GATHER(small), BROADCAST((small,))        # taken: cc_codeline line 2
    sent.append({"grads": [g.asnumpy().copy() for g in grads], "small": small.asnumpy().copy()})
    return reduced, gathered, cast


def sync_metric(value):
    return ALL_REDUCE(value)                                       # not in cc_codeline


def codeline_patterns():
    """The regular expressions of the two call lines of `exchange`, as a user would write them."""
    lines, first = inspect.getsourcelines(exchange)
    numbers = [first + i for i, text in enumerate(lines) if "# taken" in text]
    return [f"cc_worker\\.py\\[{n}\\]" for n in numbers]


def train(config, rank, steps, out_dir):
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    path = os.path.join(out_dir, f"config_rank{rank}.json")   # one per rank: a shared file races between ranks
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as handle:
        json.dump(config, handle)
    ms.set_seed(0)
    model = nn.Dense(4, 3)
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)
    monitor = TrainerMon(path, params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    grad_fn = value_and_grad(lambda x: (model(x) ** 2).mean(), None, optimizer.parameters)
    rng = np.random.default_rng(10 + rank)
    sent = []
    try:
        for step in range(steps):
            train.step = step
            _, grads = grad_fn(ms.Tensor(rng.standard_normal((5, 4)).astype(np.float32)))
            small = ms.Tensor((rng.standard_normal((2, 3)) * (rank + 1)).astype(np.float32))
            reduced, _, _ = exchange(grads, small, sent)
            sync_metric(ms.Tensor(np.float32(step + rank)))
            optimizer(tuple(r / 2 for r in reduced))
    finally:
        monitor.close()
    return sent


def main():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank = get_rank()
    global ALL_REDUCE, ALL_GATHER, BROADCAST
    ALL_REDUCE, ALL_GATHER, BROADCAST = ops.AllReduce(), ops.AllGather(), ops.Broadcast(0)
    base = sys.argv[1]
    config = {"cc_distribution": {"enable": True, "cc_pre_hook": True, "cc_codeline": codeline_patterns()},
              "ops": ["min", "max", "mean", "norm"], "ndigits": 12}
    sent = train(config, rank, STEPS, os.path.join(base, "stats"))
    np.savez(os.path.join(base, f"sent_rank{rank}.npz"),
             **{f"{s}_grad{i}": g for s, step in enumerate(sent) for i, g in enumerate(step["grads"])},
             **{f"{s}_small": step["small"] for s, step in enumerate(sent)})
    print("patched after close:", "__call__" in vars(ops.AllReduce), flush=True)
    try:
        train({"cc_distribution": {"enable": True, "cc_log_only": True}}, rank, 5, os.path.join(base, "log_only"))
    except CollectivesLogged as stop:
        print(f"stopped: code {stop.code} at step {train.step}; patched: {'__call__' in vars(ops.AllReduce)}", flush=True)


if __name__ == "__main__":
    main()
