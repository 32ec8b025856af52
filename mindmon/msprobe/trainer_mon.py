"""`TrainerMon`: msprobe's monitor API, translated onto mindmon's tensor-statistics feature.

Change one import line of an msprobe training script:

    from mindmon.msprobe import TrainerMon          # was: from msprobe.mindspore import TrainerMon
    monitor = TrainerMon("./monitor_config.json", params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)

The config.json becomes a mindmon configuration (`monitor.tensor_stats`, its `alert` block as
`monitor.alert`), the factory builds the group with msprobe's CSV as the output (or the sink a front door
hands in: kj600's TensorBoard), and the feature's hooks (mindmon.features.tensor_stats.hooks) attach to
the model and this optimizer instance. The group is flushed at every optimizer step end.
"""
import dataclasses
import logging
import os
import warnings
from typing import Callable, Dict, Optional, Sequence, Tuple

from mindmon.parallel.chunks import as_model
from mindmon.config import ConfigError, MindmonConfig, MonitorConfig, is_int
from mindmon.parallel.data_parallel import DataParallel
from mindmon.core.engine import Sink
from mindmon.features.tensor_stats.config import TensorStatsConfig, load_config_json, parse_ops
from mindmon.features.tensor_stats.dynamic import ConfigWatcher, dynamic_mode
from mindmon.features.tensor_stats.hooks import TensorStatsHooks, attachment
from mindmon.features.tensor_stats.points import ACTV, ACTV_GRAD, GRAD_REDUCED, GRAD_UNREDUCED
from mindmon.features.tensor_stats.sink import MsprobeCsvSink
from mindmon.formats.msprobe_csv import output_root as csv_output_root, run_folder_name
from mindmon.msprobe.step_events import StepEvents
from mindmon.parallel.layout import ParallelLayout

logger = logging.getLogger("mindmon")


class TrainerMon:
    """msprobe's `TrainerMon` (MindSpore flavour) for weights, gradients, optimizer state and activations.
    The keyword-only arguments serve other front doors: an already parsed `config`; the `sink` to write to
    instead of msprobe's CSV files (kj600 hands in its TensorBoard sink) and the `run_folder` its other
    files (stack_info.csv) go to; the parameters to watch when no optimizer is given
    (`parameters_without_optimizer(model)`: kj600 watches the model's; msprobe, none)."""

    # msprobe's MindSpore TrainerMon numbers a collective function's calls from attaching on, never again
    # from 0 (the call index in the tags and the anomaly dump)
    CC_CALLS_RESTART_EACH_STEP = False

    def __init__(self, config_file_path: Optional[str], process_group=None, params_have_main_grad: bool = True,
                 opt_ty=None, *, config: Optional[TensorStatsConfig] = None, sink: Optional[Sink] = None,
                 run_folder: Optional[Callable[[], str]] = None, extra_sinks: Sequence[Sink] = (),
                 parameters_without_optimizer: Callable[[object], Sequence] = lambda model: ()):
        if opt_ty is not None:
            warnings.warn("TrainerMon(opt_ty=...) is deprecated and ignored: the optimizer type is read from "
                          "the optimizer given to set_monitor", DeprecationWarning, stacklevel=2)
        self.hooks: Optional[TensorStatsHooks] = None
        self._config = config if config is not None else load_config_json(config_file_path)
        self.config_path = config_file_path
        self.process_group = process_group
        self.pipeline = pipeline_layout(process_group)
        self.params_have_main_grad = params_have_main_grad
        self.sink = sink if sink is not None else self._csv_sink()
        self.run_folder = run_folder or self._run_folder
        self._api_folder: Optional[str] = None
        self.parameters_without_optimizer = parameters_without_optimizer
        self.extra_sinks = list(extra_sinks)
        self.rank = DataParallel().rank
        self.group = None
        self.step_events: Optional[StepEvents] = None
        self.model = None
        self.wrapped_optimizer = None
        self._ops = self.config.ops

    def _csv_sink(self) -> Optional[MsprobeCsvSink]:
        """msprobe's CSV files; none with `format: "api"` (the numbers only through generate_*_metrics)."""
        return MsprobeCsvSink.for_config(self.config, msprobe_names=True) if self.config.writes_csv else None

    def _run_folder(self) -> str:
        """Where module_struct.json and stack_info.csv go: the CSV run folder, or one of the same name
        with `format: "api"`."""
        if self.sink is not None:
            return self.sink.folder
        if self._api_folder is None:
            self._api_folder = os.path.join(csv_output_root(), run_folder_name(self.rank))
        return self._api_folder

    @classmethod
    def from_config(cls, config: TensorStatsConfig, sinks: Sequence[Sink] = (), params_have_main_grad: bool = True
                    ) -> "TrainerMon":
        """A TrainerMon from an already parsed configuration, writing to the CSV sink and to `sinks` too."""
        return cls(None, None, params_have_main_grad, config=config, extra_sinks=sinks)

    # --- msprobe's public API -------------------------------------------------------------------------

    @property
    def config(self) -> TensorStatsConfig:
        """The running configuration (dynamic on/off and reload_xy change it while training)."""
        return self.hooks.config if self.hooks is not None else self._config

    @property
    def step(self) -> int:
        return self.hooks.step if self.hooks is not None else 0

    @property
    def ops(self) -> Tuple[str, ...]:
        return self._ops

    @ops.setter
    def ops(self, ops: Sequence[str]) -> None:
        warnings.warn("setting TrainerMon.ops while training is deprecated; rows of the current CSV file "
                      "keep its header", DeprecationWarning, stacklevel=2)
        self._ops = parse_ops("ops", list(ops))
        if self.hooks is not None:
            self.hooks.set_ops(self._ops)

    def set_monitor(self, model, *args, later: Optional[TensorStatsConfig] = None, **kwargs) -> None:
        """Attach to `model`'s cells and parameters and this `optimizer` instance. Both argument orders are
        taken: msprobe's MindSpore code's `(model, optimizer, grad_acc_steps=1, tp_group=None, dp_group=None,
        start_iteration=0)` and the documented `(model, grad_acc_steps, optimizer, dp_group=None,
        tp_group=None, start_iteration=0)`, told apart by the second argument (an optimizer has
        `.parameters`). `model` may be the list of a virtual pipeline's chunks: their names get msprobe's
        `<chunk>:` prefix (mindmon.parallel.chunks) and the CSV's `vpp_stage` column is the chunk. Checks everything
        before training. With DYNAMIC_MONITOR=True only the step-end hook is attached until config.json says
        `dynamic_on: true` (mindmon/features/tensor_stats/dynamic.py). `later` (mindmon's): the configuration
        that applies once `take_optimizer` gives the optimizer it needs; the outputs are built for it."""
        given = set_monitor_arguments(args, kwargs)
        self._attach(model, later=later, **given)

    def _attach(self, model, grad_acc_steps: int, optimizer, dp_group=None, tp_group=None, start_iteration: int = 0,
                *, later: Optional[TensorStatsConfig] = None) -> None:
        for key, value, low in (("grad_acc_steps", grad_acc_steps, 1), ("start_iteration", start_iteration, 0)):
            if not is_int(value) or value < low:
                raise ConfigError(f"{key}: got {value!r}; allowed: an int >= {low}")
        if isinstance(model, (list, tuple)) and not model:
            raise ConfigError("model: got an empty list; allowed: a model or the list of its virtual-pipeline "
                              "chunks")
        model = as_model(model)
        if self.hooks is not None or self.group is not None:
            raise RuntimeError("set_monitor was already called on this TrainerMon; make one TrainerMon per run")
        watcher = ConfigWatcher(self.config_path) if dynamic_mode() and self.config_path else None
        timed = self._timed(later)
        if watcher is None and (not (self.config.active or timed) or not self.config.selects_rank(self.rank)):
            logger.info("mindmon: TrainerMon collects nothing on rank %d (no *_distribution switched on, or the "
                        "rank is not in module_ranks)", self.rank)
            return
        self.model = model
        config = self.config if self._ops == self.config.ops else dataclasses.replace(self.config, ops=self._ops)
        hooks = self._build(config, watcher, later, timed)   # None: the speed block alone
        if hooks is not None and hooks.cc_monitor is not None:
            hooks.cc_monitor.calls_restart_each_step = self.CC_CALLS_RESTART_EACH_STEP
        self.group.setup(start_step=start_iteration, micro_steps_per_step=grad_acc_steps)
        at = attachment(model, grad_acc_steps, optimizer, dp_group, tp_group, self.parameters_without_optimizer(model))
        self.step_events = StepEvents(self.group, start_iteration, self.group.flush) if timed else None
        try:
            if self.step_events is not None:   # its StepBegin resets the monitors: before the step's first record
                self.step_events.attach_model(model)
            if hooks is not None:
                hooks.attach(at, start_iteration)
            if self.step_events is not None and at.optimizer is not None:   # its flush after param_updated
                self.step_events.attach_optimizer(at.optimizer)
        except BaseException:   # a refused configuration leaves nothing attached and no files open
            if self.step_events is not None:
                self.step_events.remove()
            self.group.close()
            self.group = None
            raise
        if self.step_events is not None and at.optimizer is None:
            logger.info("mindmon: TrainerMon speed: the step's times start once the optimizer is given")
        self.hooks = hooks

    def _timed(self, later: Optional[TensorStatsConfig]) -> bool:
        """The `speed` block (mindmon's) is on: the step's events go to the speed monitor."""
        speed = (later or self.config).speed
        return speed is not None and speed.active

    def _build(self, config: TensorStatsConfig, watcher, later: Optional[TensorStatsConfig],
               timed: bool) -> TensorStatsHooks:
        """The group (built by the factory from the translated config: `later`'s, when it is given, which
        asks for as much or more) and the feature's hooks, running `config` for now. `timed`: the step
        events' hooks end every step (StepEvents), not the statistics' hooks at the collected ones."""
        from mindmon.core.factory import assemble

        outputs_for = later or config
        sections = {"tensor_stats": outputs_for, "alert": outputs_for.alert}
        outputs = [s for s in [self.sink] if s is not None] + self.extra_sinks
        if timed:   # the speed records: mindmon's JSONL, $MONITOR_OUTPUT_DIR/rank_<r>/metrics.jsonl
            from mindmon.sinks.jsonl import JsonlSink

            sections["speed"] = outputs_for.speed
            outputs.append(JsonlSink(csv_output_root(), config_key="MONITOR_OUTPUT_DIR"))
        translated = MindmonConfig(MonitorConfig(output_dir=csv_output_root(), sections=sections))
        run = assemble(translated, model=self.model if timed else None,   # speed.flops counts the model's matmuls
                       rank=self.rank, logger=logger, parameter_names=(), outputs=outputs,
                       data_parallel=DataParallel(), layout=self.pipeline)
        self.group = run.group
        return run.tensor_stats_hooks(config=config, run_folder=self.run_folder, watcher=watcher,
                                      on_step_end=self._statistics_step_end if timed else self.group.flush,
                                      params_have_main_grad=self.params_have_main_grad)

    def _statistics_step_end(self, step: int) -> None:
        """With the speed block the step events flush every step once they have the optimizer; before that
        (kj600's hook_modules without one) the statistics' step end still does."""
        if self.step_events is None or not self.step_events.has_optimizer:
            self.group.flush(step)

    def take_optimizer(self, optimizer, config: TensorStatsConfig) -> None:
        """An optimizer given after set_monitor, before training: the hooks attach to it, with `config`
        (the one given to set_monitor as `later`)."""
        hooks = self.hooks
        if hooks is not None:
            at = attachment(self.model, hooks.at.grad_acc_steps, optimizer, hooks.at.dp_group, hooks.at.tp_group)
            hooks.reattach(at, config)
            optimizer = at.optimizer
        if self.step_events is not None:
            self.step_events.attach_optimizer(optimizer)

    def reload_xy(self, xy_distribution: bool = False) -> None:
        """Switches activation collection on or off from the next hook call on (deprecated: dynamic on/off
        does this and more)."""
        warnings.warn("TrainerMon.reload_xy is deprecated: use dynamic on/off (DYNAMIC_MONITOR=True and "
                      "dynamic_on in config.json)", DeprecationWarning, stacklevel=2)
        config = dataclasses.replace(self.config, xy_distribution=bool(xy_distribution))
        if self.hooks is None:
            logger.warning("mindmon: reload_xy(%s) before set_monitor attached anything: it takes effect when "
                           "set_monitor is called", xy_distribution)
            self._config = config
            return
        self.hooks.switch_to(config)

    def set_wrapped_optimizer(self, optimizer) -> None:
        warnings.warn("TrainerMon.set_wrapped_optimizer is deprecated: pass the optimizer to set_monitor",
                      DeprecationWarning, stacklevel=2)
        self.wrapped_optimizer = optimizer

    def monitor_gnorm_with_ad(self, model, grad_acc_steps: int, optimizer=None, dp_group=None, tp_group=None,
                              start_iteration: int = 0) -> None:
        warnings.warn("TrainerMon.monitor_gnorm_with_ad is deprecated: use set_monitor", DeprecationWarning,
                      stacklevel=2)
        optimizer = optimizer if optimizer is not None else self.wrapped_optimizer
        if optimizer is None:
            raise ConfigError("optimizer: got None; allowed: the optimizer, given here or to set_wrapped_optimizer")
        self.set_monitor(model, grad_acc_steps=grad_acc_steps, optimizer=optimizer, dp_group=dp_group,
                         tp_group=tp_group, start_iteration=start_iteration)

    def generate_wgrad_metrics(self) -> Tuple[Dict[str, Dict[str, float]], Dict[str, Dict[str, float]]]:
        """Statistics of the gradients now: (reduced, unreduced), each {parameter name: {op: value}}.
        `reduced` reads each parameter's `main_grad`/`grad`; `unreduced` the micro-batch gradients summed
        so far in the current step. Empty when gradients are not monitored."""
        if self.hooks is None or not self.hooks.config.wg_distribution:
            return {}, {}
        tables = self.hooks.gradient_tables()
        return tables[GRAD_REDUCED], tables[GRAD_UNREDUCED]

    def generate_xy_metrics(self) -> Tuple[Dict[str, Dict[str, float]], Dict[str, Dict[str, float]]]:
        """Statistics of the activations collected so far in the current step: (actv, actv_grad), each
        {row name: {op: value}}, a name seen in several micro-steps with its latest values."""
        tables = self.hooks.activation_tables() if self.hooks is not None else {ACTV: {}, ACTV_GRAD: {}}
        return tables[ACTV], tables[ACTV_GRAD]

    def close(self) -> None:
        """Detach every hook (the optimizer and the parameters are as before set_monitor); close the files."""
        if self.hooks is not None:
            self.hooks.detach()
        if self.step_events is not None:
            self.step_events.remove()
        if self.group is not None:
            self.group.close()


DOCUMENTED_ORDER = ("grad_acc_steps", "optimizer", "dp_group", "tp_group", "start_iteration")
MSPROBE_MINDSPORE_ORDER = ("optimizer", "grad_acc_steps", "tp_group", "dp_group", "start_iteration")
SET_MONITOR_DEFAULTS = {"grad_acc_steps": 1, "dp_group": None, "tp_group": None, "start_iteration": 0}


def set_monitor_arguments(args: tuple, kwargs: dict) -> dict:
    """`set_monitor`'s arguments after the model, by name, in either order: msprobe's MindSpore code puts
    the optimizer second (and tp_group before dp_group), its documentation grad_acc_steps second. An int
    cannot be an optimizer and an optimizer is no int, so the second argument's type decides."""
    order = MSPROBE_MINDSPORE_ORDER if args and is_optimizer(args[0]) else DOCUMENTED_ORDER
    if len(args) > len(order):
        raise ConfigError(f"set_monitor: got {len(args) + 1} positional arguments; allowed: at most "
                          f"{len(order) + 1} (model, {', '.join(order)})")
    unknown = sorted(set(kwargs) - set(order))
    if unknown:
        raise ConfigError(f"set_monitor: got the keyword {unknown[0]!r}; allowed: {', '.join(order)}")
    given = dict(zip(order, args))
    twice = sorted(set(given) & set(kwargs))
    if twice:
        raise ConfigError(f"set_monitor: {twice[0]} given twice (by position and by keyword); allowed: once")
    given.update(kwargs)
    if "optimizer" not in given:
        raise ConfigError("set_monitor: optimizer missing; allowed: set_monitor(model, optimizer, "
                          "grad_acc_steps=1, ...) or set_monitor(model, grad_acc_steps, optimizer, ...)")
    return {**SET_MONITOR_DEFAULTS, **given}


def is_optimizer(value) -> bool:
    """An optimizer (or a wrapper of one whose `step()` runs the update): something with `.parameters` or a
    `step` method; never an int."""
    return not isinstance(value, int) and (hasattr(value, "parameters") or callable(getattr(value, "step", None)))


def pipeline_layout(process_group) -> Optional[ParallelLayout]:
    """msprobe's `process_group`: the pipeline-parallel group (its name), whose rank index is the `pp_stage`
    of the anomaly dump and whose ranks are its `group_mates`. None: one stage."""
    if process_group is None:
        return None
    allowed = ("allowed: the name of the pipeline-parallel communication group (created with "
               "mindspore.communication.create_group), or None for one stage")
    if not isinstance(process_group, str) or not process_group:
        raise ConfigError(f"process_group: got {process_group!r}; {allowed}")
    try:
        group = DataParallel(process_group)
    except ConfigError:
        raise ConfigError(f"process_group: got {process_group!r}, a communication group that does not exist (or "
                          f"does not hold this rank); {allowed}") from None
    return ParallelLayout({"pp": group}, rank=DataParallel().rank)
