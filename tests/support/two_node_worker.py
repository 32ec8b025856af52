"""An msrun worker for tests/parallel/test_two_nodes.py: a plain data-parallel MindSpore loop monitored by mindmon,
with an alert rule that fires on every step's device loss, delivered to SQLite.

    two_node_worker.py OUTPUT_DIR STEPS SQLITE_PATH

Rank r trains on its own batches (seeded by r); prints `step <n>` after each step and `trained` at the end.
"""
import logging
import sys

import numpy as np

K = 2          # micro-steps per step
FEATURES = 3


def batch(rank: int, step: int):
    rng = np.random.default_rng(1000 * rank + step)
    x = rng.normal(size=(2 * K, FEATURES)).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.1 * rank).astype(np.float32)


def config(output_dir: str, sqlite_path: str) -> dict:
    return {"monitor": {"output_dir": output_dir,
                        "train_state": {"local_loss": True, "device_loss": True, "device_norm": True},
                        "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 0.0},
                                             "kinds": ["device_loss"]}],
                                  "inform": {"recipient": "database", "connection_str": f"sqlite:///{sqlite_path}"}}}}


def main(output_dir: str, steps: int, sqlite_path: str) -> None:
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops
    from mindspore.communication import get_rank, init

    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank = get_rank()

    class Linear(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weight = Parameter(Tensor(np.full((FEATURES, 1), 0.25, np.float32)), name="linear.weight")

        def construct(self, x, y):
            diff = ops.matmul(x, self.weight) - y
            return (diff * diff).mean()

    net = Linear()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.05)
    group = build_group(parse_sections(config(output_dir, sqlite_path)),
                        parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=K, group=group)
    group.setup(max_steps=steps)
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        train_step(split_batch((Tensor(x), Tensor(y)), K))
        group.flush(step)
        print(f"step {step}", flush=True)
    group.close()
    print("trained", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
