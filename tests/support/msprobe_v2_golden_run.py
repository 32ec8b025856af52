"""One small MindSpore training run under monitor_v2's `TrainerMonitorV2`, msprobe's or mindmon's:

    python msprobe_v2_golden_run.py msprobe|mindmon CONFIG.json [optimizer]

The user's loop as monitor_v2 documents it for MindSpore: `start(model=, optimizer=)`, value_and_grad
per micro-batch, the summed gradients to the optimizer, `step()` after it. The golden test runs it with
msprobe 26.2.0 in a separate virtual environment and with mindmon, on the same data."""
import sys

import mindspore as ms
from mindspore import nn, value_and_grad

from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support
from tests.support.msprobe_reference import K, STEPS, batches, make_model, make_optimizer


def main(which: str, config_path: str, optimizer_kind: str = "experimental.Adam") -> None:
    if which == "msprobe":
        from msprobe.core.monitor_v2 import TrainerMonitorV2
    else:
        from mindmon.msprobe import TrainerMonitorV2
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = make_model()
    model.set_train(True)
    optimizer = make_optimizer(optimizer_kind, model.trainable_params())
    monitor = TrainerMonitorV2(config_path, fr="mindspore")
    monitor.start(model=model, optimizer=optimizer)
    loss_fn = nn.MSELoss()
    grad_fn = value_and_grad(lambda x, y: loss_fn(model(x), y) / K, None, optimizer.parameters)
    for step in range(STEPS):
        summed = None
        for x, y in batches()[step]:
            _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
            summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
        optimizer(summed)
        monitor.step()
    monitor.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
