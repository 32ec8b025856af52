"""kj600's `TrainerMon`: `hook_modules(model, grad_acc_steps)`, `set_wrapped_optimizer`, TensorBoard output.

The config file takes kj600's keys (every msprobe key too): `targets` with specs, `print_struct`,
`module_ranks`, `xy_distribution`, `wg_distribution`, `mv_distribution`, `ops` (with `id`, the value of a
0-dim tensor), `eps`, `alert` (`rules`, `inform`), `ur_distribution` (its heat maps as TensorBoard images),
`mg_direction`, `cc_distribution`; `opt_ty` (argument or key) is accepted and ignored: the Adam moments are found on
the optimizer itself.

Steps: with an optimizer (given to `set_wrapped_optimizer` before `hook_modules`) a step ends at each
optimizer call, as with msprobe; without one, after every `grad_acc_steps` forward calls of the model (the
step is written when the next one starts, and at `close()`).

Output: `$KJ600_OUTPUT_DIR/<MonDD_HH-MM-SS>-rank<r>-<id>/rank_<r>/events.out.tfevents.*`, tags
`<point>/<name>/<statistic>` (`actv/fc1.output/norm`, `grad_reduced/fc1.weight/norm`), per-step points
against the step (from 1), activations against the global micro-step ((step - 1) * K + micro_step).
"""
import logging
import os
import uuid
import warnings
from datetime import datetime

from ..config import ConfigError
from ..msprobe.config import RUN_FOLDER_TIME_FORMAT, parse_tensor_stats, read_config_json
from ..msprobe.trainer_mon import TrainerMon as MsprobeTrainerMon
from ..sinks.tensorboard import TensorBoardSink

logger = logging.getLogger("mindmon")

OUTPUT_DIR_ENV = "KJ600_OUTPUT_DIR"
DEFAULT_OUTPUT_DIR = "./kj600_output"
IGNORED_KEYS = ("opt_ty",)


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

    _wrapped_optimizer = None

    def __init__(self, config_file_path: str, params_have_main_grad: bool = True, opt_ty=None,
                 process_group=None):
        if opt_ty is not None:
            logger.info("mindmon: kj600 TrainerMon(opt_ty=%r) is ignored: the optimizer's Adam moments are found on "
                        "the optimizer itself", opt_ty)
        self._setup(load_kj600_config(config_file_path), [])
        self.config_path = config_file_path
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad

    @classmethod
    def set_wrapped_optimizer(cls, optimizer) -> None:
        """kj600 calls it on the class, after the optimizer is built and before `hook_modules`."""
        cls._wrapped_optimizer = optimizer

    def hook_modules(self, model, grad_acc_steps: int) -> None:
        """Hooks the model (and the optimizer given to set_wrapped_optimizer, if any)."""
        optimizer, type(self)._wrapped_optimizer = type(self)._wrapped_optimizer, None   # one run per optimizer
        if optimizer is None and self.config.collects_parameters:
            raise ConfigError("wg_distribution/mv_distribution/param_distribution: got true, but no optimizer; "
                              "allowed: call TrainerMon.set_wrapped_optimizer(optimizer) before hook_modules")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.set_monitor(model, grad_acc_steps, optimizer)
        if self._activations is not None:
            logger.info("> %d out of %d modules are monitored.", self._hooked_cells,
                        len(list(model.cells_and_names())))

    def _make_sink(self):
        stamp = datetime.now().strftime(RUN_FOLDER_TIME_FORMAT)
        sink = TensorBoardSink(os.path.join(output_dir(), f"{stamp}-rank{self.rank}-{uuid.uuid4().hex[:8]}"))
        sink.folder = sink.tensorboard_dir
        return sink

    def close(self) -> None:
        """Writes the step in flight (without an optimizer its end is only known here), then detaches."""
        pending = getattr(self, "_micro_steps", None) is not None and self._micro_steps.forwards
        if pending and getattr(self, "_optimizer", None) is None:
            self._after_update(None, (), None)
        super().close()
