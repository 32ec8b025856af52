"""The msprobe front door (`TrainerMon`) under model parallelism, inside the msrun workers of
tests/support/parallel_worker.py (the same launch, the same groups):

    vpp: PP=2 x DP=2, each stage holding 2 virtual-pipeline chunks (tests/support/parallel_model.py's VirtualPipeline),
         `set_monitor([chunk0, chunk1], ..., dp_group)` with `process_group` the pipeline group; gradients,
         weights and every cell's activations, and an alert rule that fires on every value (the dump's order).
    tp:  TP=2 x DP=2 (the tensor-parallel block), `set_monitor(net, ..., tp_group, dp_group)`: grad_reduced
         rows once per data-parallel group, replicated parameters once per tensor-parallel group.

Each trains with SGD, gradients averaged over the data-parallel group by the loop, no clipping;
MONITOR_OUTPUT_DIR is `OUT`.
"""
import json
import os

import numpy as np

from tests.support import parallel_reference as ref

STEPS = {"vpp": 2, "tp": 1}
TARGETS = {"0:layers.0": {}, "layers.0.weight": {}}   # chunk 0's layer, and the weight of every chunk
OPS = ["norm", "mean", "max"]
ALERT = {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1e-12}}], "dump": True}


def config(mode: str) -> dict:
    if mode == "vpp":
        return {"targets": TARGETS, "xy_distribution": True, "all_xy": True, "wg_distribution": True,
                "param_distribution": True, "ops": OPS, "alert": ALERT}
    return {"wg_distribution": True, "ops": ["norm"]}


def _mean_over(group, grads):
    from mindspore import ops

    reduce = ops.AllReduce(group=group)
    return tuple(reduce(g) / 2.0 for g in grads)


def run(mode: str, out: str, data, k: int, rows: int, lr: float) -> None:
    import mindspore as ms
    from mindspore import Tensor, nn

    from mindmon.msprobe import TrainerMon
    from mindmon.parallel import megatron_layout
    from tests.support.parallel_model import TensorParallelBlock, VirtualChunk, VirtualPipeline

    from mindspore.communication import get_rank

    os.makedirs(out, exist_ok=True)
    os.environ["MONITOR_OUTPUT_DIR"] = out
    path = os.path.join(out, f"config_{mode}_rank{get_rank()}.json")   # one per rank: no rank reads a half-written one
    with open(path, "w") as f:
        json.dump(config(mode), f)
    if mode == "vpp":
        layout = megatron_layout(pp=2)
        stage, pipeline = layout.index("pp"), layout.groups["pp"].group
        chunks = [VirtualChunk(ref.vpp_parameters(), chunk, stage) for chunk in range(ref.VPP_CHUNKS)]
        net = VirtualPipeline(chunks, stage, pipeline)
        model, params = chunks, chunks[0].trainable_params() + chunks[1].trainable_params()
        monitor = TrainerMon(path, process_group=pipeline, params_have_main_grad=False)
    else:
        layout = megatron_layout(tp=2)
        net = TensorParallelBlock(ref.tp_parameters(), layout.groups["tp"].group, layout.index("tp"), 2)
        model, params = net, net.trainable_params()
        monitor = TrainerMon(path, params_have_main_grad=False)
    net.set_train(True)
    optimizer = nn.SGD(params, learning_rate=lr)
    dp = layout.groups["dp"].group
    monitor.set_monitor(model, k, optimizer, dp_group=dp, tp_group=layout.groups["tp"].group if mode == "tp" else None)
    grad_fn = ms.value_and_grad(net, None, optimizer.parameters)
    replica = layout.index("dp")
    for x, target in data[:STEPS[mode]]:
        total = None
        for j in range(k):
            start = (replica * k + j) * rows
            _, grads = grad_fn(Tensor(x[start:start + rows].astype(np.float32)),
                               Tensor(target[start:start + rows].astype(np.float32)))
            grads = tuple(g / k for g in grads)
            total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
        optimizer(_mean_over(dp, total))
    monitor.close()
