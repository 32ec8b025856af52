"""Stock MindFormers 2.0.0 training, without mindmon (MINDMON_AUTOLOAD=0): the demo model and data of the
tests, the config given as JSON in argv[1]; with `--mindmon-max-logits`, mindmon's MaxLogitsMonitor is passed to
the Trainer as a plain MindFormers callback. Its log (LOG_MF_PATH) is what tests/mindformers/test_mindformers2.py compares
with mindmon's numbers.

What differs from a run on an accelerator, and why (docs/testing.md): the fused gradient norm stacks the
per-tensor squares with `mint.stack`, whose StackExt kernel MindSpore 2.10 has no CPU build of, so here it is
summed one tensor at a time (the same sum); and the step backpropagates a loss sense of shape (1,), so the
model returns its loss with that shape (the same value). hyper_parallel is the tests' single-device stand-in.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "hyper_parallel_standin"))

import mindspore as ms  # noqa: E402
from mindspore import mint  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)

sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support
from tests.support.demo_trainer import SMALL_MODEL, make_data  # noqa: E402
from mindmon.demo.model import DemoModelConfig, DemoMoEGPT  # noqa: E402
from mindmon.features.max_logits.callback import MaxLogitsMonitor  # noqa: E402


class LossOfShapeOne(DemoMoEGPT):
    def construct(self, input_ids, labels):
        (loss,) = super().construct(input_ids, labels)
        return (loss.reshape(1),)


def _sum_of_squares_one_by_one(local_grads, grad_factors):
    total = None
    for grad, factor in zip(local_grads, grad_factors):
        square = mint.sum(mint.square(grad.astype(ms.float32))) / factor
        total = square if total is None else total + square
    return total


def main():
    import mindformers.pynative.trainer.utils as trainer_utils
    from mindformers.pynative.trainer import Trainer

    trainer_utils._compute_grad_norm_sq_fused = _sum_of_squares_one_by_one
    config = json.loads(sys.argv[1])
    model = LossOfShapeOne(DemoModelConfig.from_dict(SMALL_MODEL))
    # mindmon's MaxLogitsMonitor standing alone as a MindFormers callback, next to MindFormers' own from the YAML
    callbacks = [MaxLogitsMonitor(step_interval=1)] if "--mindmon-max-logits" in sys.argv else None
    Trainer(config=config, model=model, train_dataset=make_data(config), callbacks=callbacks).train()
    print("stock run done")


if __name__ == "__main__":
    main()
