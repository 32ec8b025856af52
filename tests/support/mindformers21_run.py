"""MindFormers 2.1.0's Trainer with mindmon attached by its autoload, in a process of its own: 2.1.0's source
(unpacked beside .venv-ms210 by `make install-ms210`, not installed: it requires MindSpore 2.11) and the
hyper_parallel stand-in go first on sys.path. argv: the config as JSON, the output of the trainer's
`training_step` name, and `mindspore-adamw` (MindSpore's AdamWeightDecay passed in, as 2.1.0's own AdamW
has no CPU kernel) or `mindformers-adamw` (2.1.0's own, from the config)."""
import json
import sys
from pathlib import Path

SUPPORT = Path(__file__).parent
sys.path[:0] = [str(Path(sys.prefix) / "mindformers-2.1.0"), str(SUPPORT / "hyper_parallel_standin")]

import mindspore as ms  # noqa: E402
from mindspore import nn  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)

sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support
from tests.support.demo_trainer import SMALL_MODEL, make_model  # noqa: E402
from mindmon.demo.data import make_dataset  # noqa: E402


def main():
    import mindformers
    from mindformers.pynative.trainer import Trainer

    config, optimizer = json.loads(sys.argv[1]), sys.argv[2]
    training = config["training"]
    # 2.1.0's step reads one micro-batch of local_batch_size samples at a time
    data = make_dataset(training["steps"] * training["global_batch_size"], SMALL_MODEL["seq_length"],
                        SMALL_MODEL["vocab_size"], training["local_batch_size"], seed=3)
    model = make_model()
    extra = {}
    if optimizer == "mindspore-adamw":
        extra = {"optimizer": nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2, weight_decay=0.01),
                 "lr_scheduler": lambda step: 1e-2}
    print("versions:", mindformers.__version__, Trainer.training_step.__name__, flush=True)
    Trainer(config=config, model=model, train_dataset=data, **extra).train()
    print("trained", flush=True)


if __name__ == "__main__":
    main()
