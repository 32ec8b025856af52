"""A plain MindSpore training loop monitored by mindmon, for the fault tests.

    python plain_loop_job.py OUTPUT_DIR STEPS [FSIZE_LIMIT_BYTES [METRICS_FORMATS]]

Prints `step <n>` after each step and `after train` once `group.close()` has returned: the line a
user's code after training would reach. With FSIZE_LIMIT_BYTES, files may not grow past that size
(writes beyond it fail with EFBIG, as on a full disk). METRICS_FORMATS: monitor.metrics_formats,
comma-separated (default: jsonl).
"""
import logging
import resource
import signal
import sys

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch


class Regression(nn.Cell):
    def __init__(self):
        super().__init__()
        self.weight = Parameter(Tensor(np.full((3, 1), 0.5, np.float32)), name="layer.weight")
        self.bias = Parameter(Tensor(np.zeros(1, np.float32)), name="layer.bias")

    def construct(self, x, y):
        diff = ops.matmul(x, self.weight) + self.bias - y
        return (diff * diff).mean()


def main(output_dir: str, steps: int, fsize_limit: int = 0, formats: str = "jsonl") -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    config = parse_sections({"monitor": {"output_dir": output_dir, "metrics_formats": formats.split(","), "train_state": {
        "local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True}}})
    group = build_group(config, parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=2, group=group)
    group.setup(max_steps=steps)
    if fsize_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # an over-limit write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    rng = np.random.default_rng(0)
    for step in range(1, steps + 1):
        x = rng.normal(size=(4, 3)).astype(np.float32)
        y = (x @ np.array([[1.0], [-2.0], [0.5]])).astype(np.float32)
        train_step(split_batch((Tensor(x), Tensor(y)), 2))
        group.flush(step)
        print(f"step {step}", flush=True)
    group.close()
    print("after train", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0,
         sys.argv[4] if len(sys.argv) > 4 else "jsonl")
