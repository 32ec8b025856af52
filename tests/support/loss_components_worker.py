"""An msrun worker for tests/features/loss_components/test_loss_components.py: the demo model on two data-parallel ranks, each with
its own batches, through AccumulatingTrainStep with the loss components on. Each rank writes its JSONL to
<output_dir>/rank_<r>/."""
import sys

import numpy as np
from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support


def main(output_dir: str, steps: str, micro_steps: str) -> None:
    import mindspore as ms
    from mindspore import Tensor, nn
    from mindspore.communication import get_rank, init

    from tests.support.demo_trainer import SMALL_MODEL, make_model
    from mindmon import AccumulatingTrainStep, build_group, parse_sections

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank, k = get_rank(), int(micro_steps)
    model = make_model()
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2)
    config = parse_sections({"monitor": {"output_dir": output_dir, "loss_components": {"enabled": True}}})
    group = build_group(config, model=model, parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(lambda ids, labels: model(ids, labels)[0], optimizer, k, group)
    data = np.random.default_rng(11 + rank)   # each rank its own tokens
    group.setup()
    for step in range(1, int(steps) + 1):
        shape = (2, SMALL_MODEL["seq_length"])
        micro = [tuple(Tensor(data.integers(0, SMALL_MODEL["vocab_size"], shape).astype(np.int32)) for _ in "xy")
                 for _ in range(k)]
        loss, grad_norm = train_step(micro)
        group.flush(step, loss=loss, grad_norm=grad_norm)
    group.close()
    print(f"loss_components_worker rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
