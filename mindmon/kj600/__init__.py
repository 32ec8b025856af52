"""kj600 (TensorProbe), msprobe's predecessor, on mindmon: its entry points over the same engine.

    from mindmon.kj600.module_hook import TrainerMon     # was: from kj600.module_hook import TrainerMon
    hooker = TrainerMon("./llama2_config.json", params_have_main_grad=True, opt_ty=None)
    hooker.hook_modules(model=model, grad_acc_steps=K)
    TrainerMon.set_wrapped_optimizer(optimizer)           # optional: weights, gradients, Adam state

TensorBoard event files go to `$KJ600_OUTPUT_DIR` (default ./kj600_output); see docs/activations.md.
"""
from mindmon.kj600.module_hook import TrainerMon

__all__ = ["TrainerMon"]
