"""One data-parallel rank of an msprobe-style loop, started by msrun (see test_msprobe_data_parallel.py).

Rank r trains on the reference batches scaled by (1 + r); after the K micro-batches the summed gradients
are averaged over the ranks with one AllReduce and passed to the optimizer. A second argument `relu_cell`
trains the activation tests' model (its ReLU a cell of its own; test_tensor_stats_activations_multi_rank.py).
"""
import sys

import mindspore as ms
from mindspore import nn, ops, value_and_grad
from mindspore.communication import GlobalComm, get_group_size, get_rank, init

from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support
from tests.support.activations_reference import make_relu_model
from tests.support.msprobe_reference import K, batches, make_model, make_optimizer
from mindmon.msprobe import TrainerMon

STEPS = 2


def main(config_path: str, model_kind: str = "mlp") -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank, size = get_rank(), get_group_size()
    model = make_relu_model() if model_kind == "relu_cell" else make_model()
    model.set_train(model_kind == "relu_cell")   # activations are collected from cells in training mode
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    monitor = TrainerMon(config_path, params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer, dp_group=GlobalComm.WORLD_COMM_GROUP)
    loss_fn = nn.MSELoss()
    grad_fn = value_and_grad(lambda x, y: loss_fn(model(x), y) / K, None, optimizer.parameters)
    all_reduce = ops.AllReduce()
    for step in range(STEPS):
        summed = None
        for x, y in batches()[step]:
            _, grads = grad_fn(ms.Tensor(x * (1 + rank)), ms.Tensor(y))
            summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
        optimizer(tuple(all_reduce(g) / size for g in summed))


if __name__ == "__main__":
    main(*sys.argv[1:3])
