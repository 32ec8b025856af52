"""kj600's `TrainerMon`: `hook_modules(model, grad_acc_steps)`, `set_wrapped_optimizer`, TensorBoard output.

The config file takes kj600's keys (every msprobe key too): `targets` with specs, `print_struct`,
`module_ranks`, `xy_distribution`, `wg_distribution`, `mv_distribution`, `ops` (with `id`, the value of a
0-dim tensor), `eps`, `alert` (`rules`, `inform`), `ur_distribution` (its heat maps as TensorBoard images),
`mg_direction`, `cc_distribution`; `opt_ty` (argument or key) is accepted and ignored: the Adam moments are found on
the optimizer itself.

Steps: with an optimizer (given to `set_wrapped_optimizer` before `hook_modules`, or after it as kj600's
README does) a step ends at each optimizer call, as with msprobe; without one, after every `grad_acc_steps`
forward calls of the model (the step is written when the next one starts, and at `close()`), and
`wg_distribution` hooks the model's parameters (`grad_unreduced` only: nothing reduces for an optimizer).

Output: `$KJ600_OUTPUT_DIR/<MonDD_HH-MM-SS>-rank<r>-<id>/events.out.tfevents.*`, the run folder itself as
kj600's and msprobe's writers use it (one folder per rank and run), in msprobe's tag spelling
(mindmon/formats/msprobe_tags.py): `0:fc1.weight/rank0/post_grad_norm`, `0:fc1.output:1/rank0/actv_norm`
(micro-step 1), `0:core.attention:0/rank0/qkt_entropy`, `AllReduce/rank0/post_0_0_norm`, every value
against the 0-based step.
"""
import dataclasses
import logging
import os
import uuid
import warnings
from datetime import datetime
from typing import Optional

from mindmon.features.tensor_stats.config import (RUN_FOLDER_TIME_FORMAT, TensorStatsConfig, parse_tensor_stats,
                                                 read_config_json)
from mindmon.parallel.data_parallel import DataParallel
from mindmon.msprobe.trainer_mon import TrainerMon as MsprobeTrainerMon
from mindmon.sinks.tensorboard import msprobe_tensorboard_sink

logger = logging.getLogger("mindmon")

OUTPUT_DIR_ENV = "KJ600_OUTPUT_DIR"
DEFAULT_OUTPUT_DIR = "./kj600_output"
IGNORED_KEYS = ("opt_ty",)
OPTIMIZER_KEYS = ("param_distribution", "mv_distribution", "ur_distribution", "mg_direction")   # need its calls


def output_dir() -> str:
    return os.environ.get(OUTPUT_DIR_ENV) or DEFAULT_OUTPUT_DIR


def load_kj600_config(path: str):
    """A kj600 config file: msprobe's keys, plus `opt_ty` (ignored, with a note)."""
    raw = read_config_json(path)
    if isinstance(raw, dict) and any(key in raw for key in IGNORED_KEYS):
        logger.info("mindmon: kj600 config key opt_ty is ignored: the optimizer's Adam moments are found on the "
                    "optimizer itself")
        raw = {k: v for k, v in raw.items() if k not in IGNORED_KEYS}
    return parse_tensor_stats(raw)


class TrainerMon(MsprobeTrainerMon):
    """kj600's monitor: msprobe's TrainerMon with kj600's entry points and TensorBoard output."""

    CC_CALLS_RESTART_EACH_STEP = True   # kj600's tags count a collective's calls within the step
    _wrapped_optimizer = None   # given to set_wrapped_optimizer before hook_modules
    _awaiting = None            # the TrainerMon whose hook_modules ran without one: the next set_wrapped_optimizer's

    def __init__(self, config_file_path: str, params_have_main_grad: bool = True, opt_ty=None,
                 process_group=None):
        if opt_ty is not None:
            logger.info("mindmon: kj600 TrainerMon(opt_ty=%r) is ignored: the optimizer's Adam moments are found on "
                        "the optimizer itself", opt_ty)
        rank = DataParallel().rank
        stamp = datetime.now().strftime(RUN_FOLDER_TIME_FORMAT)
        sink = msprobe_tensorboard_sink(os.path.join(output_dir(), f"{stamp}-rank{rank}-{uuid.uuid4().hex[:8]}"),
                                        per_rank=False)
        super().__init__(config_file_path, process_group, params_have_main_grad,
                         config=load_kj600_config(config_file_path), sink=sink,
                         run_folder=lambda: sink.tensorboard_dir,
                         parameters_without_optimizer=lambda model: tuple(model.trainable_params()))
        self.later: Optional[TensorStatsConfig] = None   # what waits for set_wrapped_optimizer
        self.hooked = None                               # (model, grad_acc_steps) of hook_modules

    @classmethod
    def set_wrapped_optimizer(cls, optimizer) -> None:
        """kj600 calls it on the class, after `hook_modules` once the optimizer exists (its README's order)
        or before it: either way the optimizer's calls end the steps from then on."""
        waiting, TrainerMon._awaiting = TrainerMon._awaiting, None
        if waiting is not None and waiting.before_training():
            waiting.attach_optimizer(optimizer)
        else:
            TrainerMon._wrapped_optimizer = optimizer

    def hook_modules(self, model, grad_acc_steps: int) -> None:
        """Hooks the model, and the optimizer given to set_wrapped_optimizer if any. Without one, gradients
        are hooked on the model's parameters and a step is grad_acc_steps forwards; what needs an optimizer
        (param_distribution, mv_distribution, ur_distribution, mg_direction) waits for set_wrapped_optimizer."""
        optimizer, TrainerMon._wrapped_optimizer = TrainerMon._wrapped_optimizer, None   # one run per optimizer
        if optimizer is None:
            self._wait_for_optimizer()
        self.hooked = (model, grad_acc_steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.set_monitor(model, grad_acc_steps, optimizer, later=self.later)
        self._log_monitored()

    def _wait_for_optimizer(self) -> None:
        TrainerMon._awaiting = self
        needing = [key for key in OPTIMIZER_KEYS if getattr(self.config, key)]
        if needing:
            logger.info("mindmon: kj600 TrainerMon: %s wait for TrainerMon.set_wrapped_optimizer(optimizer); "
                        "they are collected from the step it is given", ", ".join(needing))
            self.later = self.config
            self._config = dataclasses.replace(self.config, **{key: False for key in needing})

    def attach_optimizer(self, optimizer) -> None:
        """The optimizer given after hook_modules, still before training (kj600's recipe): the hooks attach
        to it; a ConfigError now when it keeps no moments the config asks for."""
        config = self.later or self.config
        model, grad_acc_steps = self.hooked
        if self.hooks is None:   # nothing could be collected without it: attach now
            self._config, self.later = config, None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self.set_monitor(model, grad_acc_steps, optimizer)
            return
        self.take_optimizer(optimizer, config)
        self.later = None

    def before_training(self) -> bool:
        """No forward has run since hook_modules (an optimizer given later belongs to a later run)."""
        return self.hooks is None or (self.hooks.step == 0 and self.hooks.micro_steps.forwards == 0)

    def _log_monitored(self) -> None:
        if self.hooks is None or self.hooks.activations is None:
            return
        for name in self.hooks.activations.monitored:
            logger.info("> %s is monitored successfully", name)
        logger.info("> %d out of %d modules are monitored.", self.hooks.hooked_cells,
                    len(list(self.model.cells_and_names())))   # the chunks of a virtual pipeline together

    def close(self) -> None:
        """Writes the step in flight (without an optimizer its end is only known here), then detaches."""
        if TrainerMon._awaiting is self:
            TrainerMon._awaiting = None
        if self.hooks is not None:
            self.hooks.end_pending_step()
        super().close()
