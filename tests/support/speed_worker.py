"""An msrun worker for tests/features/speed/test_speed_ranks.py: a small regression trained data-parallel with monitor.speed.
Every rank's forward sleeps BASE seconds (a computing time that costs no CPU, so four ranks on two cores
stay comparable); one rank's sleeps SLEEP more at chosen steps.

    speed_worker.py OUTPUT_DIR STEPS SLOW_RANK SLOW_STEPS SLEEP [tp|pp|ep]

SLOW_RANK -1: a balanced run. SLOW_STEPS: comma-separated steps (or "-"). `tp` (`pp`): a TP=2 x DP=2
(PP=2 x DP=2) layout (mindmon.parallel.megatron_layout; the model is replicated over the model-parallel pair,
which trains on its replica's data), so the step's collectives are the data-parallel all-reduce and the
model-parallel sums; `ep`: EP=2 carved out of DP=4 (the model has no experts: every parameter is a copy).
"""
import sys
import time
from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support

K, LOCAL_BATCH = 2, 4
BASE = 0.2
SLOW_RANK_FACTOR = 2.0


def main(output_dir: str, steps: int, slow_rank: int, slow_steps: set, sleep: float, model_parallel: str) -> int:
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn
    from mindspore.communication import get_rank, init

    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
    from tests.support.scripts.plain_loop_job import Regression

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank = get_rank()
    model = Regression()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.05)
    config = {"monitor": {"output_dir": output_dir, "train_state": {"local_loss": True},
                          "speed": {"enabled": True, "slow_rank_factor": SLOW_RANK_FACTOR}}}
    layout, replica = None, rank
    if model_parallel:
        from mindmon.parallel import megatron_layout

        layout = megatron_layout(**{model_parallel: 2})
        replica = layout.index("dp")
    group = build_group(parse_sections(config), model=model, parameter_names=[p.name for p in optimizer.parameters],
                        layout=layout)
    current = {"step": 0, "micro": 0}

    def loss_fn(x, y):
        time.sleep(BASE + (sleep if rank == slow_rank and current["step"] in slow_steps and current["micro"] == 0
                           else 0.0))
        current["micro"] += 1
        return model(x, y)

    train_step = AccumulatingTrainStep(loss_fn, optimizer, K, group=group, layout=layout)
    group.setup(max_steps=steps, micro_steps_per_step=K)
    x = np.random.default_rng(replica).normal(size=(K * LOCAL_BATCH, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]])).astype(np.float32)
    for step in range(1, steps + 1):
        current["step"], current["micro"] = step, 0
        train_step(split_batch((Tensor(x), Tensor(y)), K))
        group.flush(step)
    group.close()
    print(f"speed_worker rank {rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    chosen = set() if sys.argv[4] == "-" else {int(s) for s in sys.argv[4].split(",")}
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), chosen, float(sys.argv[5]), "".join(sys.argv[6:7])))
