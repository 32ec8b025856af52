"""What differs between the MindFormers PyNative Trainers mindmon attaches to: one `TrainerVersion` per
supported release line, and the one table (`STEP_ADAPTERS`) where each line's `training_step` signature is
turned into mindmon's step.

1.9.x  `training_step(model, inputs, grad_fn)` with the step's whole batch; no monitor of its own; refuses
       more than one process (mindmon runs the data parallelism).
2.0.x  `training_step(inputs, loss=, grad_norm=, step=)` with the step's whole batch; `self.model` is a list
       of model chunks; `self.monitor` is MindFormers' MonitorGroup (record protocol), flushed by its
       MonitorCallback.
2.1.x  `training_step(step=None)`, which fetches its K micro-batches itself (`self._next_batch()`); the
       loop calls `self.monitor.setup(config, state)`, `.flush(step)` and `.close()` itself.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

from mindmon.loop.step import AccumulatingTrainStep, split_batch


def _micro_batches_of_batch(trainer, inputs):
    return split_batch(inputs, trainer.num_accumulation_steps)


def _fetched_micro_batches(trainer):
    return [trainer._next_batch() for _ in range(trainer.num_accumulation_steps)]


def run_step(trainer, micro_batches):
    """mindmon's step on the Trainer: K forward/backward passes, one update (mindmon.loop.step), built at the
    first step from what `_attach` left on the trainer."""
    state = trainer._mindmon
    # 2.1's dynamic batch changes K between steps; each micro-batch loss is scaled by the step's own 1/K
    if state.train_step is None or state.train_step.num_micro_steps != trainer.num_accumulation_steps:
        state.train_step = AccumulatingTrainStep(
            lambda batch: trainer.compute_loss(trainer.model, batch), trainer.optimizer,
            trainer.num_accumulation_steps, group=state.group, max_norm=trainer.config.training.max_norm,
            data_parallel=state.data_parallel, layout=state.layout)
    return state.train_step(micro_batches)


def _step_1_9(self, model, inputs, grad_fn):
    del model, grad_fn   # model is self.model; mindmon's own gradient function scales each loss by 1/K
    return run_step(self, _micro_batches_of_batch(self, inputs))


def _step_2_0(self, inputs, loss=None, grad_norm=None, step=None):
    del loss, grad_norm, step   # the stock step's accumulators (0.0) and step number; mindmon returns its own
    return run_step(self, _micro_batches_of_batch(self, inputs))


def _step_2_1(self, step=None):
    del step
    return run_step(self, _fetched_micro_batches(self))


# The one place each line's `training_step(...)` call is adapted to mindmon's step.
STEP_ADAPTERS = {"1.9.": _step_1_9, "2.0.": _step_2_0, "2.1.": _step_2_1}


@dataclass(frozen=True)
class TrainerVersion:
    """One MindFormers release line's PyNative Trainer, as mindmon patches it."""

    prefix: str
    needed: Tuple[str, ...]         # the Trainer attributes mindmon patches or calls
    own_monitor: bool               # the Trainer builds a MonitorGroup of its own (`self.monitor`)
    single_process_view: bool       # its constructor refuses several processes (mindmon runs them)

    @property
    def training_step(self):
        return STEP_ADAPTERS[self.prefix]


_COMMON = ("__init__", "training_step", "compute_loss", "_inner_train_loop", "_create_callback_handler",
           "_compute_data_parallel_size")
VERSIONS = (
    TrainerVersion("1.9.", _COMMON, own_monitor=False, single_process_view=True),
    TrainerVersion("2.0.", _COMMON, own_monitor=True, single_process_view=False),
    TrainerVersion("2.1.", _COMMON + ("_next_batch",), own_monitor=True, single_process_view=False),
)
SUPPORTED_VERSIONS = tuple(v.prefix for v in VERSIONS)


def trainer_version(version: str) -> Optional[TrainerVersion]:
    return next((v for v in VERSIONS if version.startswith(v.prefix)), None)


def model_chunks(trainer) -> list:
    """2.x keeps `self.model` as a list of model chunks (one without pipeline parallelism); 1.9 a Cell."""
    model = trainer.model
    return list(model) if isinstance(model, (list, tuple)) else [model]
