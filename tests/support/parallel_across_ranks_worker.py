"""An msrun worker for tests/features/across_ranks/test_across_ranks_parallel.py: the hand-sharded transformer block of
tests/support/parallel_model.py trained under TP=2 x DP=2 (tests/support/parallel_worker.py's `tp` run: its data, rates and
clipping) with monitor.across_ranks on, and, as a second run, the same with pipeline parallelism asked for,
which is refused.

    parallel_across_ranks_worker.py OUT
"""
import sys

import numpy as np

from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support
from tests.support import parallel_worker as worker

CONFIG = {"train_state": {"local_norm": True, "local_loss": True, "device_loss": True},
          "across_ranks": {"enabled": True}}


def train(out: str) -> None:
    from mindspore import Tensor, nn

    from mindmon import AccumulatingTrainStep, build_group, parameter_names, parse_sections, split_batch

    layout, net = worker.build("tp")
    net.set_train(True)
    optimizer = nn.SGD(net.trainable_params(), learning_rate=worker.LR)
    group = build_group(parse_sections({"monitor": {"output_dir": out, **CONFIG}}), model=net,
                        parameter_names=parameter_names(net, optimizer), layout=layout)
    train_step = AccumulatingTrainStep(net, optimizer, worker.K, group, max_norm=worker.MAX_NORM["tp"], layout=layout)
    group.setup(max_steps=worker.STEPS)
    replica, rows = layout.index("dp"), worker.K * worker.ROWS
    for step, (x, target) in enumerate(worker.data("tp"), start=1):
        batch = (Tensor(x[replica * rows:(replica + 1) * rows].astype(np.float32)),
                 Tensor(target[replica * rows:(replica + 1) * rows].astype(np.float32)))
        loss, grad_norm = train_step(split_batch(batch, worker.K))
        group.flush(step, loss=loss, grad_norm=grad_norm)
    group.close()


def refused_under_pipeline(out: str) -> None:
    from mindmon import build_group, parse_sections
    from mindmon.config import ConfigError
    from mindmon.parallel import megatron_layout

    try:
        build_group(parse_sections({"monitor": {"output_dir": out, **CONFIG}}), layout=megatron_layout(pp=2))
    except ConfigError as error:
        print(f"refused pp: {error}", flush=True)
    else:
        print("accepted pp", flush=True)


def main() -> int:
    import mindspore as ms
    from mindspore.communication import init

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    init("mccl")
    train(sys.argv[1])
    refused_under_pipeline(sys.argv[1] + "-pp")
    print(f"parallel_across_ranks_worker rank {worker.layout_rank()}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
