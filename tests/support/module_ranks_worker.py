"""One rank of test_msprobe_module_ranks.py, started by msrun with two workers on CPU (mccl). Each rank trains the
msprobe reference MLP on its own (no reduction between them): rank 0 with nn.AdamWeightDecay, rank 1 with
mindspore.experimental.optim.AdamW, so their rows differ and each has a numpy reference.

Phase 1: `module_ranks: [1]`: rank 0 collects nothing. Phase 2: every rank collects (the input of the test's
csv2tensorboard_by_step with process_num 2).
"""
import json
import os
import sys

import mindspore as ms
from mindspore.communication import get_rank, init

from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support
from tests.support.msprobe_reference import make_model, make_optimizer, train_steps
from mindmon.msprobe import TrainerMon

OPTIMIZERS = {0: "AdamWeightDecay", 1: "experimental.AdamW"}


def run(config, out_dir, rank):
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"config_rank{rank}.json")
    with open(path, "w") as handle:
        json.dump(config, handle)
    model = make_model()
    model.set_train(True)
    optimizer = make_optimizer(OPTIMIZERS[rank], model.trainable_params())
    monitor = TrainerMon(path, params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    train_steps(model, optimizer)
    monitor.close()


def main():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank = get_rank()
    base = sys.argv[1]
    section = {"wg_distribution": True, "param_distribution": True, "ops": ["min", "max", "mean", "norm"],
               "ndigits": 12}
    run(dict(section, module_ranks=[1]), os.path.join(base, "one_rank"), rank)
    run(section, os.path.join(base, "every_rank"), rank)
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
