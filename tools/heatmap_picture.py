"""The heat-map picture of docs/msprobe.md: a real run through kj600's TrainerMon with ur_distribution
(an MLP 16 -> 64 -> 16 learning a fixed random linear map with nn.Adam, lr 0.01, K = 2, 40 steps), the
last image of one parameter's heat map read back from the event file with TensorBoard's reader.

    python tools/heatmap_picture.py docs/images/adam_update_heatmap.png [adam_update|adam_ratio]
"""
import glob
import json
import os
import sys
import tempfile

import mindspore as ms   # before tensorboard: the other order breaks MindSpore's protobuf modules
import numpy as np


def train(folder: str, steps: int = 40, micro_steps: int = 2) -> None:
    from mindspore import nn, ops, value_and_grad

    from mindmon.kj600.module_hook import TrainerMon

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    ms.set_seed(0)
    rng = np.random.default_rng(0)
    target = rng.standard_normal((16, 16)).astype(np.float32) / 4

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Dense(16, 64), nn.Dense(64, 16)

        def construct(self, x):
            return self.fc2(ops.relu(self.fc1(x)))

    model = MLP()
    model.set_train(True)
    optimizer = nn.Adam(model.trainable_params(), learning_rate=0.01)
    config = os.path.join(folder, "kj600_config.json")
    with open(config, "w") as handle:
        json.dump({"targets": {}, "ur_distribution": True, "ops": ["norm"]}, handle)
    monitor = TrainerMon(config, params_have_main_grad=False)
    TrainerMon.set_wrapped_optimizer(optimizer)
    monitor.hook_modules(model, micro_steps)
    loss_fn = nn.MSELoss()
    grad_fn = value_and_grad(lambda x, y: loss_fn(model(x), y) / micro_steps, None, optimizer.parameters)
    for _ in range(steps):
        summed = None
        for _ in range(micro_steps):
            x = rng.standard_normal((32, 16)).astype(np.float32)
            _, grads = grad_fn(ms.Tensor(x), ms.Tensor(x @ target))
            summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
        optimizer(summed)
    monitor.close()


def main(out: str, kind: str = "adam_update") -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as folder:
        os.environ["KJ600_OUTPUT_DIR"] = folder
        train(folder)
        (events,) = glob.glob(os.path.join(folder, "*-rank0-*"))   # kj600's run folder holds the events
        accumulator = EventAccumulator(events, size_guidance={"images": 0})
        accumulator.Reload()
        image = accumulator.Images(f"0:fc1.weight/rank0/{kind}")[-1]   # msprobe's spelling
        with open(out, "wb") as handle:
            handle.write(image.encoded_image_string)
        print(f"{out}: step {image.step}, {image.width} x {image.height}")


if __name__ == "__main__":
    main(*sys.argv[1:])
