"""mindmon on the MindFormers 1.9.x, 2.0.x and 2.1.x PyNative Trainers, with no change to the launch script.

`enable()` patches the stock `Trainer` class (idempotent):
  * `__init__` reads the documented `monitor:`, `profiler:` and `callbacks:` sections, validates
    them before anything is built (a bad value stops the run here, naming the key), hands the
    stock config only what the stock Trainer understands, then registers mindmon's callbacks; on 2.x
    the Trainer's `monitor` becomes mindmon's MonitorGroup;
  * `training_step` runs the K = global_batch_size / (dp x local_batch_size) micro-steps (one
    forward/backward each, gradients accumulated, one update) and records into the MonitorGroup;
    each release line's signature is adapted in mindmon.integrations.mindformers_versions;
  * on 1.9.x, with several processes (msrun), which 1.9.0 refuses, the world size goes to the
    data-parallel size and each step averages the gradients over the ranks in one all-reduce.
"""
import contextlib
import copy
import dataclasses
import difflib
import functools
import inspect
import os
from types import SimpleNamespace

from mindmon.callbacks import MaxLogitsMonitor
from mindmon.features.max_logits.callback import MaxLogitsReset
from mindmon.config import PASSTHROUGH_MONITOR_KEYS, ConfigError, MindmonConfig, load_yaml
from mindmon.features import parse_sections
from mindmon.parallel.data_parallel import DataParallel
from mindmon.core.factory import assemble
from mindmon.features.max_logits import MAX_LOGITS_CALLBACK, MaxLogitsSection
from mindmon.features.max_logits.config import MAX_LOGITS_RESET
from mindmon.integrations.mindformers_versions import (SUPPORTED_VERSIONS, TrainerVersion, model_chunks,
                                                      trainer_version)
from mindmon.integrations.monitor_view import LoopMonitorView


class IntegrationError(RuntimeError):
    """The installed MindFormers does not have the internals mindmon patches."""


def _mindformers_logger():
    from mindformers.tools.logger import get_logger

    return get_logger()


def enable() -> None:
    """Attach mindmon to `mindformers.pynative.trainer.Trainer`. Safe to call more than once."""
    import mindformers
    from mindformers.pynative.trainer import trainer as trainer_module

    trainer_cls = trainer_module.Trainer
    if getattr(trainer_cls, "_mindmon_attached", False):
        return
    version = getattr(mindformers, "__version__", "unknown")
    line = trainer_version(version)
    missing = [name for name in (line.needed if line else ()) if not hasattr(trainer_cls, name)]
    if line is None or missing:
        raise IntegrationError(
            f"MindFormers {version} is not supported (mindmon patches the PyNative Trainer of "
            f"MindFormers {', '.join(v + 'x' for v in SUPPORTED_VERSIONS)}"
            + (f"; missing Trainer.{', Trainer.'.join(missing)}" if missing else "")
            + "). Install mindformers==1.9.0 or 2.0.0, or set MINDMON_AUTOLOAD=0 to train without mindmon.")
    _register_callbacks()
    trainer_cls.__init__ = _wrap_init(trainer_cls.__init__, line)
    if line.single_process_view:
        trainer_cls._compute_data_parallel_size = _wrap_compute_data_parallel_size(
            trainer_cls._compute_data_parallel_size)
    trainer_cls.training_step = line.training_step
    trainer_cls._mindmon_attached = True
    monitor = "; mindmon's MonitorGroup in place of MindFormers' own" if line.own_monitor else ""
    _mindformers_logger().info(
        f"mindmon: attached to the MindFormers {version} PyNative Trainer (monitor/profiler/callbacks "
        f"sections, K micro-steps per step{monitor}); set MINDMON_AUTOLOAD=0 to turn it off")


def _register_callbacks() -> None:
    """mindmon's PyNative MaxLogitsMonitor replaces the graph-mode class MindFormers registers
    under the same name (the registry is a dict: the last registration wins)."""
    from mindformers.tools.register.register import MindFormerModuleType, MindFormerRegister

    MindFormerRegister.register_cls(MaxLogitsMonitor, module_type=MindFormerModuleType.CALLBACK,
                                    alias="MaxLogitsMonitor")
    MindFormerRegister.register_cls(MaxLogitsReset, module_type=MindFormerModuleType.CALLBACK,
                                    alias="MaxLogitsReset")


def check_callback_types(config: MindmonConfig) -> None:
    """A `callbacks:` type MindFormers' registry does not know is a ConfigError naming the closest
    known names, before the Trainer is built (the registry itself fails later, inside the build)."""
    if not config.callbacks:
        return
    import mindformers  # noqa: F401  (importing it registers its callbacks)
    from mindformers.tools.register.register import MindFormerModuleType, MindFormerRegister

    known = sorted(set(MindFormerRegister.registry.get(MindFormerModuleType.CALLBACK, {})) |
                   {"MaxLogitsMonitor", "MaxLogitsReset"})
    for index, entry in enumerate(config.callbacks):
        if entry["type"] not in known:
            close = difflib.get_close_matches(entry["type"], known, n=3)
            raise ConfigError(f"callbacks[{index}].type: got {entry['type']!r}, which no MindFormers callback is "
                              f"registered as; allowed: a registered callback type"
                              + (f", e.g. {', '.join(close)}" if close else f" such as {', '.join(known[:5])}"))


def _wrap_init(stock_init, line: TrainerVersion):
    signature = inspect.signature(stock_init)

    @functools.wraps(stock_init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        raw = _raw_config(bound.arguments.get("config"))
        mindmon_config = parse_sections(raw) if raw is not None else MindmonConfig()
        check_callback_types(mindmon_config)
        if raw is not None:
            bound.arguments["config"] = stock_sections(raw)
        with _single_process_view() if line.single_process_view else contextlib.nullcontext():
            stock_init(*bound.args, **bound.kwargs)
        _attach(self, mindmon_config, line)

    return __init__


@contextlib.contextmanager
def _single_process_view():
    """1.9.0 refuses to start when the world has more than one process ("Parallel training is not
    supported yet"); mindmon runs the data parallelism itself, so the stock constructor is shown a
    world of one and `_compute_data_parallel_size` (wrapped below) is given the real one."""
    from mindformers.pynative.trainer import trainer as trainer_module

    stock = trainer_module.get_world_size
    trainer_module.get_world_size = lambda *args, **kwargs: 1
    try:
        yield
    finally:
        trainer_module.get_world_size = stock


def _wrap_compute_data_parallel_size(stock_compute):
    @functools.wraps(stock_compute)
    def _compute_data_parallel_size(self):
        self.world_size = DataParallel().size
        parallelism = self.config.parallelism
        handed_layout = trainer_layout(self) is not None   # a Trainer that runs them says how (mindmon.parallel)
        for key in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
            if self.world_size > 1 and getattr(parallelism, key) != 1 and not handed_layout:
                raise ConfigError(f"parallelism.{key}: got {getattr(parallelism, key)}; allowed: 1 (mindmon runs "
                                  f"MindFormers 1.9.0 with data parallelism only, over {self.world_size} ranks)")
        stock_compute(self)

    return _compute_data_parallel_size


def _raw_config(config):
    if isinstance(config, str):
        if not os.path.exists(config):
            return None  # the stock Trainer raises its own FileNotFoundError
        return load_yaml(config)
    if isinstance(config, dict):
        return copy.deepcopy(config)
    return None


def stock_sections(raw: dict) -> dict:
    """The config without mindmon's keys, in the shape MindFormers 1.9.0's TrainConfig accepts."""
    stock = dict(raw)
    stock.pop("profiler", None)
    monitor = stock.pop("monitor", None) or {}
    kept = {k: v for k, v in monitor.items() if k in PASSTHROUGH_MONITOR_KEYS}
    if kept:
        stock["monitor"] = kept
    if isinstance(stock.get("optimizer"), dict) and "qk_clip_enabled" in stock["optimizer"]:
        stock["optimizer"] = {k: v for k, v in stock["optimizer"].items() if k != "qk_clip_enabled"}
    return stock


def _rank() -> int:
    try:
        from mindspore.communication import get_rank

        return int(get_rank())
    except Exception:  # communication not initialised: a single process
        return int(os.environ.get("RANK_ID", "0"))


def trainer_layout(trainer):
    """The `mindmon.parallel.ParallelLayout` a Trainer that runs model parallelism hands mindmon as its
    `mindmon_layout` attribute, or None (MindFormers 1.9.0's PyNative Trainer has none: it runs data
    parallelism only)."""
    return getattr(trainer, "mindmon_layout", None)


def _attach(trainer, config: MindmonConfig, line: TrainerVersion) -> None:
    training = trainer.config.training
    data_parallel = trainer.config.parallelism.data_parallel
    if training.global_batch_size % (data_parallel * training.local_batch_size):
        raise ConfigError(
            f"training.global_batch_size: got {training.global_batch_size}, which is not a multiple of "
            f"data_parallel ({data_parallel}) x training.local_batch_size ({training.local_batch_size}); "
            f"allowed: a multiple, so that every step runs whole micro-batches")
    per_batch = training.global_batch_size // data_parallel if line.prefix != "2.1." else training.local_batch_size
    _check_batch_size(trainer.train_dataset, per_batch, training.local_batch_size)
    model = _single_chunk(trainer, line)
    logger = _mindformers_logger()
    config = _with_max_logits(trainer, config, logger)
    layout = trainer_layout(trainer)
    reduction = layout.data_parallel if layout is not None else DataParallel(config.monitor.data_parallel_group)
    run = assemble(config, model=model, optimizer=trainer.optimizer, rank=_rank(), logger=logger,
                   data_parallel=reduction, global_batch_size=training.global_batch_size, layout=layout)
    for callback in run.callbacks:
        trainer.callback_handler.add_callback(callback)
    _attach_tensor_stats(trainer, model, run)
    if line.own_monitor:
        trainer.monitor = LoopMonitorView(run.group)
    trainer._mindmon = SimpleNamespace(config=config, group=run.group, data_parallel=reduction, train_step=None,
                                       layout=layout)


def _single_chunk(trainer, line: TrainerVersion):
    """The model mindmon monitors. MindFormers 2.x runs its own parallelism through hyper_parallel, which
    mindmon's step does not drive: there it attaches to a one-process, one-chunk Trainer only."""
    chunks = model_chunks(trainer)
    if not line.single_process_view and (trainer.world_size > 1 or len(chunks) > 1):
        raise ConfigError(f"parallelism: got a world of {trainer.world_size} processes and {len(chunks)} model "
                          f"chunks; allowed: one process with one model chunk (mindmon runs the MindFormers "
                          f"{line.prefix}x Trainer on one device; its parallelism runs through hyper_parallel, "
                          f"which mindmon's training step does not drive)")
    return chunks[0]


def _attach_tensor_stats(trainer, model, run) -> None:
    """`monitor.tensor_stats`: msprobe's parameter, gradient and optimizer-state hooks on this trainer's
    model and optimizer, recording into the run's group, which the trainer flushes (the gradients reach
    the optimizer as its call's argument, which is where `grad_reduced` is read)."""
    from mindmon.features.tensor_stats.hooks import attachment

    hooks = run.tensor_stats_hooks(params_have_main_grad=False) if trainer.optimizer is not None else None
    if hooks is not None:
        hooks.attach(attachment(model, trainer.num_accumulation_steps, trainer.optimizer))


def _check_batch_size(dataset, per_step: int, local_batch_size: int) -> None:
    """Each step's batch is cut into K micro-batches of local_batch_size samples: a dataset batched by
    something else would train silently on other micro-batches."""
    get_batch_size = getattr(dataset, "get_batch_size", None)
    size = get_batch_size() if callable(get_batch_size) else None
    if size is not None and size != per_step:
        raise ConfigError(f"train_dataset: yields batches of {size} samples; allowed: global_batch_size / "
                          f"data_parallel = {per_step} samples per step, which mindmon cuts into micro-batches "
                          f"of training.local_batch_size = {local_batch_size} (batch the dataset by {per_step})")


def _is_muon(optimizer) -> bool:
    from mindformers.core.optim.muon import Muon

    return isinstance(optimizer, Muon)


def _with_max_logits(trainer, config: MindmonConfig, logger) -> MindmonConfig:
    """The config with one `MaxLogitsMonitor` entry for the MaxLogitsMonitor callbacks the trainer
    holds (from the YAML or passed in code; matched by class, so a subclass counts). With Muon and
    `qk_clip_enabled` and no such callback, one (step_interval 1) is added, so the model's running
    max is tracked and reset every step. Tracking is never switched off here."""
    handler = trainer.callback_handler
    _replace_stock_max_logits(handler)
    declared = [c for c in handler.callbacks if isinstance(c, MaxLogitsMonitor)]
    if config.qk_clip_enabled:
        if config.optimizer_type != "Muon" and not _is_muon(trainer.optimizer):
            logger.warning(f"mindmon: optimizer.qk_clip_enabled is True but the optimizer is "
                           f"{config.optimizer_type or type(trainer.optimizer).__name__}, not Muon; "
                           f"QK clip does not apply and does not switch on max-logit tracking")
        elif not declared:
            declared = [MaxLogitsMonitor(step_interval=1)]
            handler.add_callback(declared[0])
            logger.info("mindmon: Muon with qk_clip_enabled: max attention logit tracking on, and a "
                        "MaxLogitsMonitor (step_interval 1) added to reset it every step")
    wanted = [c for c in config.callbacks if c.get("type") == MAX_LOGITS_CALLBACK]
    if wanted and not declared:   # asked for by the config alone (monitor_config.max_attention_logit_format)
        declared = [MaxLogitsMonitor(step_interval=wanted[0].get("step_interval", 1),
                                     enable_logging=wanted[0].get("enable_logging", True))]
        handler.add_callback(declared[0])
    for callback in declared:   # the run's monitor reads, writes and resets; the callback stands aside
        callback.collected_by_run = True
    others = tuple(c for c in config.callbacks if c.get("type") not in (MAX_LOGITS_CALLBACK, MAX_LOGITS_RESET))
    entries = tuple({"type": MAX_LOGITS_CALLBACK, "step_interval": c.step_interval,
                     "enable_logging": c.enable_logging} for c in declared)
    callbacks = others + entries
    return dataclasses.replace(config, callbacks=callbacks).with_section(
        "max_logits", MaxLogitsSection.parse("callbacks", callbacks))


def _replace_stock_max_logits(handler) -> None:
    """MindFormers 2.x adds its own MaxLogitsMonitor when Muon's QK clip needs the running max reset and no
    callback of that name is declared; two resetters would leave mindmon's monitor a reset max. It is
    swapped for mindmon's, with the same step_interval."""
    for callback in list(handler.callbacks):
        if type(callback).__name__ in ("MaxLogitsMonitor", "MaxLogitsReset") and not isinstance(callback, MaxLogitsMonitor):
            handler.callbacks.remove(callback)
            handler.callbacks.append(MaxLogitsMonitor(step_interval=getattr(callback, "step_interval", 1),
                                                      enable_logging=getattr(callback, "enable_logging", True)))
