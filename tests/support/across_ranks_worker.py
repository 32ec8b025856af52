"""An msrun worker for tests/features/across_ranks/test_across_ranks.py: the demo MoE model trained data-parallel on its own
rank's sequences (the seed is the rank), monitored with train_state, moe_monitor and, when asked,
monitor.across_ranks, writing JSONL and TensorBoard.

    across_ranks_worker.py OUTPUT_DIR STEPS ACROSS_RANKS(0|1)

Prints `across_ranks_worker rank <r>: ok median step <seconds> s` (the median over steps 2.., for
docs/performance.md's measurement).
"""
import sys
import time

import numpy as np
from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support

K, LOCAL_BATCH = 2, 4


def config(output_dir: str, across_ranks: bool) -> dict:
    monitor = {"output_dir": output_dir, "tensorboard": {"tensorboard_dir": f"{output_dir}/tensorboard"},
               "tensorboard_tags": {"detail": "parameter"},
               "train_state": {"local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True},
               "moe_monitor": {"save_tokens_per_expert_interval": 1}}
    if across_ranks:
        monitor["across_ranks"] = {"enabled": True}
    return {"monitor": monitor}


def main(output_dir: str, steps: int, across_ranks: bool) -> int:
    import mindspore as ms
    from mindspore import Tensor, nn
    from mindspore.communication import get_rank, init

    from tests.support.demo_trainer import SMALL_MODEL, make_model
    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
    from mindmon.demo.data import make_sequences

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank = get_rank()
    ms.set_seed(0)   # the same initial weights on every rank
    model = make_model()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.05)
    group = build_group(parse_sections(config(output_dir, across_ranks)), model=model,
                        parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(lambda ids, labels: model(ids, labels)[0], optimizer, K, group=group)
    group.setup(max_steps=steps, micro_steps_per_step=K)
    sequences = make_sequences(steps * K * LOCAL_BATCH, SMALL_MODEL["seq_length"], SMALL_MODEL["vocab_size"],
                               seed=rank)
    seconds = []
    for step in range(1, steps + 1):
        batch = sequences[(step - 1) * K * LOCAL_BATCH:step * K * LOCAL_BATCH]
        start = time.perf_counter()
        train_step(split_batch((Tensor(batch[:, :-1]), Tensor(batch[:, 1:])), K))
        group.flush(step)
        seconds.append(time.perf_counter() - start)
    group.close()
    print(f"across_ranks_worker rank {rank}: ok median step {np.median(seconds[1:]):.6f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"))
