"""`TrainerMon`: msprobe's monitor API on mindmon's tensor statistics (weights, gradients, Adam state).

Change one import line of an msprobe training script:

    from mindmon.msprobe import TrainerMon          # was: from msprobe.mindspore import TrainerMon
    monitor = TrainerMon("./monitor_config.json", params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)

What it hooks, on this optimizer instance and these parameters only (never a class):
- every selected parameter's gradient hook (`wg_distribution`): the micro-batch gradients, summed
  over the step into `grad_unreduced` (or one row per micro-batch with `monitor_mbs_grad`);
- the optimizer cell's forward pre-hook: `param_origin`, `grad_reduced` (the gradients passed to the
  call, else `main_grad`/`grad` of each parameter), `exp_avg`/`exp_avg_sq` before the update;
- its forward hook: `param_updated`; then the step's records go through a MonitorGroup to the CSV
  sink (and the alert sink when config.json has an `alert` block) and the step count (0-based, from
  `start_iteration`) moves on. One optimizer call = one step.

From a MindFormers YAML (`monitor.tensor_stats`), `TrainerMon.feeding(config, group)` makes the same
hooks record into the run's MonitorGroup, which the trainer flushes with every other record.
"""
import dataclasses
import logging
import os
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

from ..compat import register_gradient_hook
from ..config import ConfigError, _is_int
from ..distributed import DataParallel
from ..engine import Sink
from ..group import MonitorGroup
from ..monitors.tensor_stats import (ACTV, ACTV_GRAD, EXP_AVG, EXP_AVG_SQ, GRAD_REDUCED, GRAD_UNREDUCED, PARAM_ORIGIN,
                                     PARAM_UPDATED, TensorStatsMonitor)
from ..sinks.csv import MsprobeCsvSink
from ..stats import host_is_device
from .accumulate import GradientSums
from ..formats.msprobe_csv import output_root as csv_output_root
from .activations import ActivationHooks, MicroSteps, check_spec_targets, root_forward_counter
from .config import TensorStatsConfig, _ops, load_config_json
from .dynamic import ConfigWatcher, dynamic_mode
from .l2_hooks import attach_l2_and_collectives, select_l2_cells
from .optimizer_state import ADAM_RATIO, ADAM_UPDATE, MG_DIRECTION, adam_state_for, ensure_monitor
from .structure import StackHooks, StopTraining, StructHooks
from .targets import find_moments, optimizer_parameters, select_parameters

logger = logging.getLogger("mindmon")


class TrainerMon:
    """msprobe's `TrainerMon` (MindSpore flavour) for weights, gradients and optimizer state."""

    def __init__(self, config_file_path: str, process_group=None, params_have_main_grad: bool = True,
                 opt_ty=None):
        if opt_ty is not None:
            warnings.warn("TrainerMon(opt_ty=...) is deprecated and ignored: the optimizer type is read from "
                          "the optimizer given to set_monitor", DeprecationWarning, stacklevel=2)
        self._setup(load_config_json(config_file_path), [])
        self.config_path = config_file_path
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad

    @classmethod
    def from_config(cls, config: TensorStatsConfig, sinks: Sequence[Sink] = (), params_have_main_grad: bool = True
                    ) -> "TrainerMon":
        """A TrainerMon from an already parsed configuration, writing to the CSV sink and to `sinks` too."""
        monitor = cls.__new__(cls)
        monitor._setup(config, list(sinks))
        monitor.config_path = None
        monitor.process_group = None
        monitor.params_have_main_grad = params_have_main_grad
        return monitor

    @classmethod
    def feeding(cls, config: TensorStatsConfig, group: MonitorGroup, params_have_main_grad: bool = True
                ) -> "TrainerMon":
        """Hooks that record into `group`, built with a TensorStatsMonitor (mindmon.factory does); the
        trainer flushes the group at step end, so nothing is written here."""
        monitor = cls.from_config(config, (), params_have_main_grad)
        monitor.group = group
        monitor.owns_group = False
        return monitor

    def _setup(self, config: TensorStatsConfig, extra_sinks: List[Sink]) -> None:
        self.config = config
        self.extra_sinks = extra_sinks
        self.rank = DataParallel().rank
        self.on_host = host_is_device()
        self.monitor: Optional[TensorStatsMonitor] = None
        self.group: Optional[MonitorGroup] = None
        self.owns_group = True
        self.sink: Optional[MsprobeCsvSink] = None
        self._ops = config.ops
        self.step = 0
        self._handles: List = []

    # --- msprobe's public API -------------------------------------------------------------------------

    @property
    def ops(self) -> Tuple[str, ...]:
        return self.monitor.ops if self.monitor is not None else self._ops

    @ops.setter
    def ops(self, ops: Sequence[str]) -> None:
        warnings.warn("setting TrainerMon.ops while training is deprecated; rows of the current CSV file "
                      "keep its header", DeprecationWarning, stacklevel=2)
        ops = _ops("ops", list(ops))
        self._ops = ops
        if self.monitor is not None:
            self.monitor.ops = ops

    def set_monitor(self, model, grad_acc_steps: int, optimizer, dp_group=None, tp_group=None,
                    start_iteration: int = 0) -> None:
        """Attach to `model`'s cells and parameters and this `optimizer` instance. Checks everything before
        training. With DYNAMIC_MONITOR=True only the step-end hook is attached until config.json says
        `dynamic_on: true` (mindmon/msprobe/dynamic.py)."""
        for key, value, low in (("grad_acc_steps", grad_acc_steps, 1), ("start_iteration", start_iteration, 0)):
            if not _is_int(value) or value < low:
                raise ConfigError(f"{key}: got {value!r}; allowed: an int >= {low}")
        if self.monitor is not None:
            raise RuntimeError("set_monitor was already called on this TrainerMon; make one TrainerMon per run")
        self._dynamic = ConfigWatcher(self.config_path) if dynamic_mode() and self.config_path else None
        if self._dynamic is None and (not self.config.active or not self.config.selects_rank(self.rank)):
            logger.info("mindmon: TrainerMon collects nothing on rank %d (no *_distribution switched on, or the "
                        "rank is not in module_ranks)", self.rank)
            return
        self.model, self.grad_acc_steps = model, grad_acc_steps
        self._groups = (dp_group, tp_group)
        self.parameters = optimizer_parameters(optimizer) if optimizer is not None else \
            self._parameters_without_optimizer(model)
        self._optimizer = optimizer
        plan = self._plan(self.config) if self._dynamic is None else None
        self.step = start_iteration
        self._build_group(start_iteration)
        self._attach_control(model, optimizer)
        if plan is not None:
            self._apply(self.config, plan)
        else:
            logger.info("mindmon: DYNAMIC_MONITOR=True: monitoring starts the step after %s says dynamic_on: true",
                        self.config_path)

    def _parameters_without_optimizer(self, model) -> tuple:
        """msprobe monitors parameters through the optimizer only (kj600's TrainerMon: the model's)."""
        return ()

    def _plan(self, config: TensorStatsConfig) -> dict:
        """What a configuration selects on this model and optimizer; a ConfigError when it cannot apply."""
        plan = {"selected": [], "moments": None, "keep_grads": {}, "adam": None}
        if config.collects_parameters:
            if not self.parameters:
                raise ConfigError("optimizer: got None; allowed: the optimizer, for param_distribution, "
                                  "wg_distribution and mv_distribution")
            plan["selected"] = select_parameters(self.model, self.parameters, config.targets, config.squash_name)
            plan["moments"] = self._moments(config, self._optimizer, len(self.parameters))
            plan["keep_grads"] = _keeps_reduced_gradients(*self._groups, self.parameters, plan["selected"])
            plan["adam"] = adam_state_for(config, self._optimizer, self.parameters)   # ur_distribution, mg_direction
        if config.collects_activations:
            check_spec_targets(self.model, config)
        if config.l2 is not None and config.l2.active:
            select_l2_cells(self.model, config.l2)   # a cell name that does not exist fails before training
        return plan

    def _apply(self, config: TensorStatsConfig, plan: dict) -> None:
        """Makes `config` the running configuration: its hooks attached, those of the previous one detached."""
        self._detach_capabilities()
        self.config = config
        self.selected, self.moments, self._keep_grads = plan["selected"], plan["moments"], plan["keep_grads"]
        self._adam = plan["adam"]
        self._running = config.active and config.selects_rank(self.rank)
        if not self._running:
            return
        self._ops = config.ops
        self.monitor.ops = config.ops
        if self.sink is not None:
            self.sink.ndigits, self.sink.significant_digits = config.ndigits, config.significant_digits
            self.sink.step_count_per_record = config.step_count_per_record
        # print_struct collects nothing else: its run ends after step 0.
        self._collecting = config.collects(self.step) and not config.print_struct
        self._attach_capabilities(config)
        logger.info("mindmon: TrainerMon collects %s for %d parameters and %d cells%s", self._points(),
                    len(self.selected), self._hooked_cells, f" into {self.sink.folder}" if self.sink else "")

    def _build_group(self, start_iteration: int) -> None:
        """Standalone: a group of its own (the statistics monitor; the CSV, alert and extra sinks).
        Feeding a trainer's group: that group's statistics monitor."""
        if not self.owns_group:
            self.monitor = next(m for m in self.group.monitors if isinstance(m, TensorStatsMonitor))
            return
        from ..alerts.sink import build_alert_sink

        self.monitor = TensorStatsMonitor(self._ops, self.config.eps, self.on_host, self.rank)
        self.sink = self._make_sink()
        sinks = [self.sink] + self.extra_sinks
        if self.config.alert is not None and self.config.alert.active:
            sinks.append(build_alert_sink(self.config.alert, csv_output_root(), self.rank, logger,
                                          DataParallel(), path="alert")[0])
        self.group = MonitorGroup([self.monitor], sinks, self.rank, logger)
        self.group.setup(start_step=start_iteration, micro_steps_per_step=self.grad_acc_steps)

    def _make_sink(self) -> Sink:
        """msprobe's CSV files (kj600's TrainerMon writes TensorBoard instead)."""
        return MsprobeCsvSink(None, self.config.ndigits, self.config.step_count_per_record,
                              self.config.significant_digits, self.config.append_output)

    def reload_xy(self, xy_distribution: bool = False) -> None:
        """Switches activation collection on or off from the next hook call on (deprecated: dynamic on/off
        does this and more)."""
        warnings.warn("TrainerMon.reload_xy is deprecated: use dynamic on/off (DYNAMIC_MONITOR=True and "
                      "dynamic_on in config.json)", DeprecationWarning, stacklevel=2)
        config = dataclasses.replace(self.config, xy_distribution=bool(xy_distribution))
        if self.monitor is None:
            logger.warning("mindmon: reload_xy(%s) before set_monitor attached anything: it takes effect when "
                           "set_monitor is called", xy_distribution)
            self.config = config
            return
        self._switch_to(config)

    def set_wrapped_optimizer(self, optimizer) -> None:
        warnings.warn("TrainerMon.set_wrapped_optimizer is deprecated: pass the optimizer to set_monitor",
                      DeprecationWarning, stacklevel=2)
        self._wrapped_optimizer = optimizer

    def monitor_gnorm_with_ad(self, model, grad_acc_steps: int, optimizer=None, dp_group=None, tp_group=None,
                              start_iteration: int = 0) -> None:
        warnings.warn("TrainerMon.monitor_gnorm_with_ad is deprecated: use set_monitor", DeprecationWarning,
                      stacklevel=2)
        optimizer = optimizer if optimizer is not None else getattr(self, "_wrapped_optimizer", None)
        if optimizer is None:
            raise ConfigError("optimizer: got None; allowed: the optimizer, given here or to set_wrapped_optimizer")
        self.set_monitor(model, grad_acc_steps, optimizer, dp_group, tp_group, start_iteration)

    def generate_wgrad_metrics(self) -> Tuple[Dict[str, Dict[str, float]], Dict[str, Dict[str, float]]]:
        """Statistics of the gradients now: (reduced, unreduced), each {parameter name: {op: value}}.
        `reduced` reads each parameter's `main_grad`/`grad`; `unreduced` the micro-batch gradients summed
        so far in the current step. Empty when gradients are not monitored."""
        if self.monitor is None or not self.config.wg_distribution:
            return {}, {}
        probe = TensorStatsMonitor(self.monitor.ops, self.config.eps, self.on_host, self.rank)
        probe.record(GRAD_REDUCED, [(name, grad) for _, name, grad in self._stored_gradients()])
        probe.record(GRAD_UNREDUCED, self._sums.named_sums())
        tables = {GRAD_REDUCED: {}, GRAD_UNREDUCED: {}}
        for record in probe.collect(self.step + 1):
            tables[record.kind][record.name] = dict(zip(record.ops, record.value))
        return tables[GRAD_REDUCED], tables[GRAD_UNREDUCED]

    def generate_xy_metrics(self) -> Tuple[Dict[str, Dict[str, float]], Dict[str, Dict[str, float]]]:
        """Statistics of the activations collected so far in the current step: (actv, actv_grad), each
        {row name: {op: value}}, a name seen in several micro-steps with its latest values."""
        tables = {ACTV: {}, ACTV_GRAD: {}}
        if self.monitor is not None:
            for entry in self.monitor.stats.results():
                if entry.point in tables:
                    tables[entry.point].update((name, dict(zip(entry.ops, row)))
                                               for name, row in zip(entry.names, entry.values.tolist()))
        return tables[ACTV], tables[ACTV_GRAD]

    def close(self) -> None:
        """Detach every hook (the optimizer and the parameters are as before set_monitor); close the
        files of a standalone TrainerMon."""
        if hasattr(self, "_sums"):   # attached
            self._detach_capabilities()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.group is not None and self.owns_group:
            self.group.close()

    # --- attaching ------------------------------------------------------------------------------------

    def _moments(self, config: TensorStatsConfig, optimizer, count: int):
        if not config.mv_distribution:
            return None
        moments = find_moments(optimizer, count)
        if moments is None:
            raise ConfigError(f"mv_distribution: got True, but the optimizer {type(optimizer).__name__} keeps no "
                              f"Adam moments; allowed: an Adam-type optimizer (nn.Adam, nn.AdamWeightDecay, "
                              f"mindspore.experimental.optim.Adam/AdamW, MindFormers AdamW) or "
                              f"mv_distribution: false")
        return moments

    def _points(self) -> List[str]:
        c = self.config
        return ([PARAM_ORIGIN, PARAM_UPDATED] if c.param_distribution else []) + \
            ([GRAD_UNREDUCED, GRAD_REDUCED] if c.wg_distribution else []) + \
            ([EXP_AVG, EXP_AVG_SQ] if c.mv_distribution else []) + \
            ([MG_DIRECTION] if c.mg_direction else []) + ([ADAM_UPDATE, ADAM_RATIO] if c.ur_distribution else []) + \
            ([p for p, off in ((ACTV, c.backward_only), (ACTV_GRAD, c.forward_only)) if not off]
             if c.collects_activations else []) + \
            (["module_struct"] if c.print_struct else []) + (["stack_info"] if c.stack_info else [])

    def _attach_control(self, model, optimizer) -> None:
        """The hooks that stay for the whole run: the step end (the optimizer call; without an optimizer,
        every grad_acc_steps forwards of the model) and the micro-step count (the model's forwards)."""
        self._running, self._collecting = False, False
        self._sums = GradientSums(self.on_host, self.config.monitor_mbs_grad, self._record_micro_gradient)
        self._micro_steps = MicroSteps()
        self._capability_handles: List = []
        self._gradient_handles: List = []
        self._activations = self._struct = self._stacks = None
        self._hooked_cells = 0
        # The optimizer first: it is the hook that can be refused, and then nothing is left attached.
        if optimizer is not None:
            self._handles += _hook_optimizer_calls(optimizer, self._before_update, self._after_update)
        by_forwards = self._end_step_by_forwards if optimizer is None else None
        self._handles.append(root_forward_counter(model, self._micro_steps, by_forwards))

    def _attach_capabilities(self, config: TensorStatsConfig) -> None:
        if config.print_struct:   # the structure only: what msprobe users run first, to write their targets
            self._struct = StructHooks()
            self._struct.attach(self.model)
            return
        self._sums.per_micro_batch = config.monitor_mbs_grad
        if self._adam is not None:
            ensure_monitor(self.group, config, self.rank)
        self._follow_collection()
        if config.collects_activations:
            self._activations = ActivationHooks(config, self._record_activations, lambda: self._collecting,
                                                self._micro_steps, self._guard)
            self._hooked_cells = self._activations.attach(self.model)
        if config.stack_info:
            self._stacks = StackHooks()
            self._stacks.attach(self.model, lambda: self._collecting)
        if config.l2_or_cc_active:
            self._capability_handles += attach_l2_and_collectives(config, self.model, self._optimizer, self.group,
                                                                  lambda: self._collecting, self.rank, self.on_host)

    def _follow_collection(self) -> None:
        """Between steps: the hooks that run in the backward pass (parameter gradients, cells' backward)
        are attached for a collected step only. MindSpore slows every step that has them, even when they
        return at once (docs/performance.md)."""
        wanted = self._running and self._collecting and self.config.wg_distribution
        if wanted and not self._gradient_handles:
            self._gradient_handles = [register_gradient_hook(self.parameters[index], self._gradient_hook(index, name))
                                      for index, name in self.selected]
        elif not wanted:
            for handle in self._gradient_handles:
                handle.remove()
            self._gradient_handles = []
        if self._activations is not None:
            self._activations.follow_collection()

    def _detach_capabilities(self) -> None:
        for handle in getattr(self, "_capability_handles", ()):
            handle.remove()
        self._capability_handles = []
        self._running = self._collecting = False
        self._follow_collection()
        for hooks in (self._activations, self._struct, self._stacks):
            if hooks is not None:
                hooks.detach()
        self._activations = self._struct = self._stacks = None
        self._hooked_cells = 0
        self._sums.release()

    def _gradient_hook(self, index: int, name: str):
        def hook(grad):
            if self._collecting:
                self._guard(self._sums.add, index, name, grad)
        return hook

    def _record_micro_gradient(self, name: str, grad, micro_step: int) -> None:
        self.group.record(GRAD_UNREDUCED, [(name, grad)], {"micro_step": micro_step})

    def _record_activations(self, point: str, named_tensors, micro_step: int) -> None:
        self.group.record(point, named_tensors, {"micro_step": micro_step})

    # --- one step -------------------------------------------------------------------------------------

    def _before_update(self, cell, inputs) -> None:
        if self._collecting:
            self._guard(self._record_before_update, inputs)

    def _after_update(self, cell, inputs, output) -> None:
        if self._collecting:
            self._guard(self._finish_step)
        self._end_step_hooks()
        self.step += 1
        self._sums.clear()
        self._micro_steps.end_step()
        if self._struct is not None:
            self._stop_after_structure()
        self._next_configuration()
        self._collecting = self._running and self.config.collects(self.step)
        self._follow_collection()

    def _end_step_by_forwards(self) -> None:
        """Without an optimizer (kj600's hook_modules): a step ends when the model starts its forward
        number grad_acc_steps + 1."""
        if self._micro_steps.forwards == self.grad_acc_steps:
            self._end_step_without_optimizer()

    def _end_step_without_optimizer(self) -> None:
        self._before_update(None, ())   # the step's summed gradients (kj600 hooks them without an optimizer)
        self._after_update(None, (), None)

    def _end_step_hooks(self) -> None:
        if self._activations is not None:
            self._activations.end_step()
        if self._stacks is not None and self._stacks.stacks:
            folder = self.sink.folder if self.sink is not None else os.path.join(csv_output_root(), "stack_info")
            self._guard(self._stacks.write, folder)
            self._stacks.detach()
            self._stacks = None

    def _stop_after_structure(self) -> None:
        struct = self._struct
        path = struct.write(csv_output_root(), self.rank)
        self.close()
        message = (f"mindmon: print_struct: the structure of {len(struct.struct)} cells is in {path}; "
                   f"training stops after step 1 as print_struct asks (set it to false to train)")
        logger.warning(message)
        raise StopTraining(message)

    def _next_configuration(self) -> None:
        """Dynamic mode: an edited config.json applies from the next step. Both modes: every capability
        hook is detached once collect_times is reached (dynamic mode also writes dynamic_on: false)."""
        if self._dynamic is not None:
            config = self._dynamic.poll(self.step - 1)
            if config is not None and not config.dynamic_on:
                if self._running:
                    logger.info("mindmon: DYNAMIC_MONITOR: dynamic_on is false; monitoring stops after step %d",
                                self.step - 1)
                self._detach_capabilities()
                return
            if config is not None:
                self._switch_to(dataclasses.replace(config, start_step=self.step))
        if self._running and self.config.finished(self.step):
            logger.info("mindmon: TrainerMon reached collect_times (%d) before step %d; its hooks are detached",
                        self.config.collect_times, self.step)
            self._detach_capabilities()
            if self._dynamic is not None:
                self._dynamic.switch_off()

    def _switch_to(self, config: TensorStatsConfig) -> None:
        """The new configuration's hooks replace the running ones; one it cannot apply leaves them."""
        try:
            plan = self._plan(config)
        except ConfigError as error:
            logger.error("mindmon: the configuration changed at step %d but %s; the running configuration stays",
                         self.step, error)
            return
        logger.info("mindmon: configuration updated; collecting by it from step %d", self.step)
        self._apply(config, plan)

    def _record_before_update(self, inputs) -> None:
        config, monitor = self.config, self.group
        if config.param_distribution:
            monitor.record(PARAM_ORIGIN, [(name, self.parameters[i]) for i, name in self.selected])
        if config.wg_distribution:
            monitor.record(GRAD_UNREDUCED, self._sums.named_sums())
        if config.wg_distribution and self._optimizer is not None:   # without one, nothing is reduced for it
            monitor.record(GRAD_REDUCED, self._reduced_gradients(inputs))
        if self.moments is not None:
            first, second = self.moments
            monitor.record(EXP_AVG, [(name, first[i]) for i, name in self.selected])
            monitor.record(EXP_AVG_SQ, [(name, second[i]) for i, name in self.selected])
        if self._adam is not None:
            self._adam.record(monitor, self.step, self._gradients_passed(inputs), config.ur_distribution,
                              config.mg_direction)

    def _finish_step(self) -> None:
        if self.config.param_distribution:
            self.group.record(PARAM_UPDATED, [(name, self.parameters[i]) for i, name in self.selected])
        if self.config.wg_distribution:
            self._sums.check_count(self.grad_acc_steps, self.step)
        if self.owns_group:
            self.group.flush(self.step + 1)  # records count steps from 1; the CSV writes step 0

    def _reduced_gradients(self, inputs) -> List[tuple]:
        return [(name, grad) for i, name, grad in self._gradients_passed(inputs) if self._keep_grads[i]]

    def _gradients_passed(self, inputs) -> List[tuple]:
        """(index, name, gradient) the optimizer gets: the tuple passed to its call, else each parameter's
        `main_grad` (when params_have_main_grad) or `grad`."""
        passed = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)) else None
        if passed is not None and len(passed) == len(self.parameters):
            return [(i, name, passed[i]) for i, name in self.selected]
        return self._stored_gradients()

    def _stored_gradients(self) -> List[tuple]:
        """(index, name, gradient) of the selected parameters that hold one in `main_grad`/`grad`."""
        found, missing = [], []
        for index, name in self.selected:
            param = self.parameters[index]
            grad = getattr(param, "main_grad", None) if self.params_have_main_grad else None
            grad = grad if grad is not None else getattr(param, "grad", None)
            (found if grad is not None else missing).append((index, name, grad))
        if missing:
            self._warn_once("missing_grad", "mindmon: no gradient for %s: neither passed to the optimizer call nor "
                            "in main_grad/grad; their grad_reduced rows are left out", [n for _, n, _ in missing])
        return found

    # --- failures -------------------------------------------------------------------------------------

    def _guard(self, function, *args) -> None:
        """A monitoring failure is logged once and training goes on; what was written stays."""
        try:
            function(*args)
        except Exception as error:  # noqa: BLE001 - the training must not die of its monitor
            self._warn_once("failure", "mindmon: TrainerMon failed at step %d and collects no more in this step: "
                            "%s: %s", self.step, type(error).__name__, error)
            self._collecting = False
            self.monitor.reset()

    def _warn_once(self, key, message: str, *args) -> None:
        warned = self.__dict__.setdefault("_warned", set())
        if key not in warned:
            warned.add(key)
            logger.warning(message, *args)


def _hook_optimizer_calls(optimizer, before, after) -> List:
    """Hooks on this optimizer instance only: a Cell's forward pre-hook and hook, or, for a plain object
    with `step()` (a Megatron-style wrapper), an instance attribute `step` wrapping the bound method.
    Returns handles whose `remove()` detaches."""
    if hasattr(optimizer, "register_forward_pre_hook"):
        return [optimizer.register_forward_pre_hook(before), optimizer.register_forward_hook(after)]
    if callable(getattr(optimizer, "step", None)):
        return [_WrappedStep(optimizer, before, after)]
    raise ConfigError(f"optimizer: got {type(optimizer).__name__}; allowed: a MindSpore optimizer Cell, or an "
                      f"object whose step() runs the update")


class _WrappedStep:
    """`optimizer.step` replaced on the instance (never on its class) by one that calls the hooks around it."""

    def __init__(self, optimizer, before, after):
        self.optimizer = optimizer
        self.had_own = "step" in vars(optimizer)
        self.original = optimizer.step

        def step(*args, **kwargs):
            before(optimizer, args)
            output = self.original(*args, **kwargs)
            after(optimizer, args, output)
            return output

        optimizer.step = step

    def remove(self) -> None:
        if self.had_own:
            self.optimizer.step = self.original
        else:
            del self.optimizer.step


def _keeps_reduced_gradients(dp_group, tp_group, parameters: Sequence, selected: Sequence[Tuple[int, str]]
                             ) -> Dict[int, bool]:
    """Per parameter index: is this rank's grad_reduced row kept? After the data-parallel reduction every
    rank of `dp_group` holds the same gradients, so only its first rank writes them; in `tp_group` the
    parameters not split across ranks (no `tensor_model_parallel` attribute) are written by its first rank."""
    first_in_dp = dp_group is None or DataParallel(dp_group).rank == 0
    first_in_tp = tp_group is None or DataParallel(tp_group).rank == 0
    return {i: first_in_dp and (first_in_tp or bool(getattr(parameters[i], "tensor_model_parallel", False)))
            for i, _ in selected}
