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

Output: `$KJ600_OUTPUT_DIR/<MonDD_HH-MM-SS>-rank<r>-<id>/rank_<r>/events.out.tfevents.*`, tags
`<point>/<name>/<statistic>` (`actv/fc1.output/norm`, `grad_reduced/fc1.weight/norm`), per-step points
against the step (from 1), activations against the global micro-step ((step - 1) * K + micro_step).
"""
import dataclasses
import logging
import os
import uuid
import warnings
from datetime import datetime

from ..msprobe.config import RUN_FOLDER_TIME_FORMAT, parse_tensor_stats, read_config_json
from ..msprobe.targets import optimizer_parameters
from ..msprobe.trainer_mon import TrainerMon as MsprobeTrainerMon
from ..sinks.tensorboard import TensorBoardSink

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

    _wrapped_optimizer = None   # given to set_wrapped_optimizer before hook_modules
    _awaiting = None            # the TrainerMon whose hook_modules ran without one: the next set_wrapped_optimizer's

    def __init__(self, config_file_path: str, params_have_main_grad: bool = True, opt_ty=None,
                 process_group=None):
        if opt_ty is not None:
            logger.info("mindmon: kj600 TrainerMon(opt_ty=%r) is ignored: the optimizer's Adam moments are found on "
                        "the optimizer itself", opt_ty)
        self._setup(load_kj600_config(config_file_path), [])
        self.config_path = config_file_path
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        self._full_config = self._hooked = None

    @classmethod
    def set_wrapped_optimizer(cls, optimizer) -> None:
        """kj600 calls it on the class, after `hook_modules` once the optimizer exists (its README's order)
        or before it: either way the optimizer's calls end the steps from then on."""
        waiting, TrainerMon._awaiting = TrainerMon._awaiting, None
        if waiting is not None and waiting._before_training():
            waiting._take_optimizer(optimizer)
        else:
            TrainerMon._wrapped_optimizer = optimizer

    def hook_modules(self, model, grad_acc_steps: int) -> None:
        """Hooks the model, and the optimizer given to set_wrapped_optimizer if any. Without one, gradients
        are hooked on the model's parameters and a step is grad_acc_steps forwards; what needs an optimizer
        (param_distribution, mv_distribution, ur_distribution, mg_direction) waits for set_wrapped_optimizer."""
        optimizer, TrainerMon._wrapped_optimizer = TrainerMon._wrapped_optimizer, None   # one run per optimizer
        if optimizer is None:
            self._wait_for_optimizer()
        self._hooked = (model, grad_acc_steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.set_monitor(model, grad_acc_steps, optimizer)
        self._log_monitored(model)

    def _wait_for_optimizer(self) -> None:
        needing = [key for key in OPTIMIZER_KEYS if getattr(self.config, key)]
        TrainerMon._awaiting = self
        if needing:
            logger.info("mindmon: kj600 TrainerMon: %s wait for TrainerMon.set_wrapped_optimizer(optimizer); "
                        "they are collected from the step it is given", ", ".join(needing))
            self._full_config = self.config
            self.config = dataclasses.replace(self.config, **{key: False for key in needing})

    def _take_optimizer(self, optimizer) -> None:
        """The optimizer given after hook_modules: hooks re-attached with it (still before training, in
        kj600's recipe); a ConfigError now when it keeps no moments the config asks for."""
        config = self._full_config or self.config
        model, grad_acc_steps = self._hooked
        if self.monitor is None:   # nothing could be collected without it: attach now
            self.config = config
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self.set_monitor(model, grad_acc_steps, optimizer)
            return
        self._detach_capabilities()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._optimizer, self.parameters = optimizer, optimizer_parameters(optimizer)
        self._attach_control(model, optimizer)
        self._apply(config, self._plan(config))

    def _before_training(self) -> bool:
        """No forward has run since hook_modules (an optimizer given later belongs to a later run)."""
        micro_steps = getattr(self, "_micro_steps", None)
        return self.step == 0 and (micro_steps is None or micro_steps.forwards == 0)

    def _log_monitored(self, model) -> None:
        if self._activations is None:
            return
        for name in self._activations.monitored:
            logger.info("> %s is monitored successfully", name)
        logger.info("> %d out of %d modules are monitored.", self._hooked_cells, len(list(model.cells_and_names())))

    def _parameters_without_optimizer(self, model) -> tuple:
        return tuple(model.trainable_params())

    def _make_sink(self):
        stamp = datetime.now().strftime(RUN_FOLDER_TIME_FORMAT)
        sink = TensorBoardSink(os.path.join(output_dir(), f"{stamp}-rank{self.rank}-{uuid.uuid4().hex[:8]}"))
        sink.folder = sink.tensorboard_dir
        return sink

    def close(self) -> None:
        """Writes the step in flight (without an optimizer its end is only known here), then detaches."""
        if TrainerMon._awaiting is self:
            TrainerMon._awaiting = None
        pending = getattr(self, "_micro_steps", None) is not None and self._micro_steps.forwards
        if pending and getattr(self, "_optimizer", None) is None:
            self._end_step_without_optimizer()
        super().close()
