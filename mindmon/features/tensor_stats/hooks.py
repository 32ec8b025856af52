"""The tensor-statistics hooks' lifecycle: attach to a model's cells and parameters and one optimizer
instance, collect every step, follow dynamic reconfiguration, detach. Every front door uses it: msprobe's
and kj600's `TrainerMon`, and the MindFormers route (`monitor.tensor_stats`).

What it hooks, on this optimizer instance and these parameters only (never a class):
- every selected parameter's gradient hook (`wg_distribution`): the micro-batch gradients, summed
  over the step into `grad_unreduced` (or one row per micro-batch with `monitor_mbs_grad`);
- the optimizer's forward pre-hook: `param_origin`, `grad_reduced` (the gradients passed to the
  call, else `main_grad`/`grad` of each parameter), `exp_avg`/`exp_avg_sq` before the update;
- its forward hook: `param_updated`; then `on_step_end(step + 1)` (a standalone front door flushes its
  group there) and the step count (0-based, from `start_iteration`) moves on. One optimizer call = one step.

The factory builds it with its monitors (mindmon.features.tensor_stats.build); it records straight into them.
"""
import dataclasses
import logging
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mindmon.compat import builtin_hooks_accepted, register_gradient_hook
from mindmon.config import ConfigError
from mindmon.parallel.data_parallel import DataParallel
from mindmon.features.l2.hooks import attach_l2_and_collectives, select_l2_cells
from mindmon.features.tensor_stats.accumulate import GradientSums
from mindmon.features.tensor_stats.activations import (ActivationHooks, MicroSteps, check_spec_targets,
                                                       root_forward_counter)
from mindmon.features.tensor_stats.config import TensorStatsConfig
from mindmon.features.tensor_stats.monitor import TensorStatsMonitor
from mindmon.features.tensor_stats.points import (ACTV, ACTV_GRAD, EXP_AVG, EXP_AVG_SQ, GRAD_REDUCED, GRAD_UNREDUCED,
                                                  PARAM_ORIGIN, PARAM_UPDATED)
from mindmon.features.tensor_stats.optimizer_state import ADAM_RATIO, ADAM_UPDATE, MG_DIRECTION, adam_state_for
from mindmon.features.tensor_stats.structure import StackHooks, StopTraining, StructHooks
from mindmon.features.tensor_stats.targets import find_moments, optimizer_parameters, select_parameters
from mindmon.formats.msprobe_csv import output_root as csv_output_root
from mindmon.core.optimizer_hooks import hook_optimizer_calls

logger = logging.getLogger("mindmon")


@dataclasses.dataclass
class Attachment:
    """What `attach` was given: the model, K, the optimizer and the groups msprobe dedups rows by."""

    model: object
    grad_acc_steps: int
    optimizer: object
    parameters: Sequence
    dp_group: object = None
    tp_group: object = None


class TensorStatsHooks:
    """The hooks of one TensorStatsConfig on one model and optimizer, recording into `monitor` (and the L2
    and collective monitors), through `recorder` (the group). `csv_sink` (when the output is msprobe's CSV) follows reconfiguration;
    `run_folder()` is where stack_info.csv goes; `watcher` polls config.json in dynamic mode."""

    def __init__(self, config: TensorStatsConfig, monitor: TensorStatsMonitor, l2_monitor=None, cc_monitor=None,
                 optimizer_state_monitor=None, csv_sink=None, run_folder: Optional[Callable[[], str]] = None, watcher=None,
                 on_step_end: Optional[Callable[[int], None]] = None, params_have_main_grad: bool = True,
                 rank: int = 0, on_host: bool = True, recorder=None):
        self.config, self.monitor = config, monitor
        # Where the hooks record and report failures: the group (which stops feeding a monitor it dropped).
        self.recorder = recorder
        self.l2_monitor, self.cc_monitor, self.csv_sink = l2_monitor, cc_monitor, csv_sink
        self.optimizer_state_monitor = optimizer_state_monitor
        self.run_folder = run_folder or (lambda: os.path.join(csv_output_root(), "stack_info"))
        self.watcher, self.on_step_end = watcher, on_step_end
        self.params_have_main_grad, self.rank, self.on_host = params_have_main_grad, rank, on_host
        self.step = 0
        self.at: Optional[Attachment] = None
        self.selected: List[Tuple[int, str]] = []
        self.moments = None
        self.adam = None                     # ur_distribution / mg_direction: the optimizer's Adam state
        self.keep_grads: Dict[int, bool] = {}
        self.running = self.collecting = False
        self.failed = False                  # a hook failed: switched off for good
        self.gradient_sums = GradientSums(on_host, config.monitor_mbs_grad, self._record_micro_gradient)
        self.micro_steps = MicroSteps()
        self.hooked_cells = 0
        self.activations: Optional[ActivationHooks] = None
        self.struct: Optional[StructHooks] = None
        self.stacks: Optional[StackHooks] = None
        self._handles: List = []             # for the whole run: the step end, the micro-step count
        self._capability_handles: List = []  # L2 features and collectives
        self._gradient_handles: List = []    # attached for collected steps only
        self._hooked_closer: Optional[int] = None   # the closer the gradient hooks were made for
        self._warned = set()

    # --- attaching ------------------------------------------------------------------------------------

    def attach(self, at: Attachment, start_iteration: int = 0) -> None:
        """Checks what the configuration selects (a ConfigError leaves nothing attached), then attaches.
        In dynamic mode only the step-end hooks are attached until config.json switches monitoring on."""
        self.at = at
        plan = self.plan(self.config) if self.watcher is None else None
        self.step = start_iteration
        self._attach_control()
        if plan is not None:
            self._apply(self.config, plan)
        else:
            logger.info("mindmon: DYNAMIC_MONITOR=True: monitoring starts the step after %s says dynamic_on: true",
                        self.watcher.path)

    def plan(self, config: TensorStatsConfig) -> dict:
        """What a configuration selects on this model and optimizer; a ConfigError when it cannot apply."""
        plan = {"selected": [], "moments": None, "keep_grads": {}, "adam": None}
        if config.collects_parameters:
            if not self.at.parameters:
                raise ConfigError("optimizer: got None; allowed: the optimizer, for param_distribution, "
                                  "wg_distribution and mv_distribution")
            plan["selected"] = select_parameters(self.at.model, self.at.parameters, config.targets, config.squash_name)
            plan["moments"] = _moments(config, self.at.optimizer, len(self.at.parameters))
            plan["keep_grads"] = keeps_reduced_gradients(self.at.dp_group, self.at.tp_group, self.at.parameters,
                                                         plan["selected"])
            plan["adam"] = adam_state_for(config, self.at.optimizer, self.at.parameters)
        if config.collects_activations:
            check_spec_targets(self.at.model, config)
        if config.l2 is not None and config.l2.active:
            select_l2_cells(self.at.model, config.l2)   # a cell name that does not exist fails before training
        return plan

    def _apply(self, config: TensorStatsConfig, plan: dict) -> None:
        """Makes `config` the running configuration: its hooks attached, those of the previous one detached."""
        self.detach_capabilities()
        self.config = config
        self.selected, self.moments, self.keep_grads = plan["selected"], plan["moments"], plan["keep_grads"]
        self.adam = plan["adam"]
        self.running = config.active and config.selects_rank(self.rank) and not self.failed
        if not self.running:
            return
        self.set_ops(config.ops)
        if self.csv_sink is not None:
            self.csv_sink.reconfigure(config)
        # print_struct collects nothing else: its run ends after step 0.
        self.collecting = config.collects(self.step) and not config.print_struct
        self._attach_capabilities(config)
        where = f" into {self.csv_sink.folder}" if self.csv_sink is not None and self.csv_sink.folder else ""
        logger.info("mindmon: TrainerMon collects %s for %d parameters and %d cells%s", self.points(),
                    len(self.selected), self.hooked_cells, where)

    def set_ops(self, ops: Sequence[str]) -> None:
        for monitor in (self.monitor, self.cc_monitor, self.optimizer_state_monitor):
            if monitor is not None:
                monitor.ops = tuple(ops)

    def points(self) -> List[str]:
        c = self.config
        return ([PARAM_ORIGIN, PARAM_UPDATED] if c.param_distribution else []) + \
            ([GRAD_UNREDUCED, GRAD_REDUCED] if c.wg_distribution else []) + \
            ([EXP_AVG, EXP_AVG_SQ] if c.mv_distribution else []) + \
            ([MG_DIRECTION] if c.mg_direction else []) + ([ADAM_UPDATE, ADAM_RATIO] if c.ur_distribution else []) + \
            ([p for p, off in ((ACTV, c.backward_only), (ACTV_GRAD, c.forward_only)) if not off]
             if c.collects_activations else []) + \
            (["module_struct"] if c.print_struct else []) + (["stack_info"] if c.stack_info else [])

    def _attach_control(self) -> None:
        """The hooks that stay for the whole run: the step end (the optimizer call; without an optimizer,
        every grad_acc_steps forwards of the model) and the micro-step count (the model's forwards)."""
        # The optimizer first: it is the hook that can be refused, and then nothing is left attached.
        if self.at.optimizer is not None:
            self._handles += hook_optimizer_calls(self.at.optimizer, self._before_update, self._after_update)
        by_forwards = self._end_step_by_forwards if self.at.optimizer is None else None
        self._handles.append(root_forward_counter(self.at.model, self.micro_steps, by_forwards, self._root_inputs))

    def _root_inputs(self, inputs: tuple):
        """The model's inputs as the activations' `input_grad` of the root cell hands them on (None: as they
        are). The counter's pre-hook asks, not a pre-hook of the activations' own: a step can end in the
        counter (no optimizer), and MindSpore fails if the root's pre-hooks change while it runs them."""
        return self.activations.root_inputs(inputs) if self.activations is not None else None

    def _attach_capabilities(self, config: TensorStatsConfig) -> None:
        if config.print_struct:   # the structure only: what msprobe users run first, to write their targets
            self.struct = StructHooks()
            self.struct.attach(self.at.model)
            return
        self.gradient_sums.per_micro_batch = config.monitor_mbs_grad
        if config.collects_activations:
            self.activations = ActivationHooks(config, self._record_activations, lambda: self.collecting,
                                               self.micro_steps, self._guard)
            self.hooked_cells = self.activations.attach(self.at.model)
        self._follow_collection()
        if config.stack_info:
            self.stacks = StackHooks()
            self.stacks.attach(self.at.model, lambda: self.collecting)
        if config.l2_or_cc_active:
            self._capability_handles += attach_l2_and_collectives(config, self.at.model, self.at.optimizer,
                                                                  self.l2_monitor, self.cc_monitor,
                                                                  lambda: self.collecting, self.recorder,
                                                                  self.at.grad_acc_steps)

    def _follow_collection(self) -> None:
        """Between steps: the parameter gradient hooks and the cells' activation hooks are attached for a
        collected step only. MindSpore slows every step that has hooks running in the backward pass, even
        when they return at once, and a cell hook that returns at once still costs its call
        (docs/performance.md)."""
        wanted = self.running and self.collecting and self.config.wg_distribution
        if wanted and self._gradient_handles and self._hooked_closer != self._closer():
            self._remove_gradient_hooks()   # the backward pass's last gradient was learned (or lost): hooked anew
        if wanted and not self._gradient_handles:
            self._hooked_closer = self._closer()
            self._gradient_handles = [register_gradient_hook(self.at.parameters[index], self._gradient_hook(index, name))
                                      for index, name in self.selected]
            self.gradient_sums.expect(len(self._gradient_handles), self.at.grad_acc_steps, self.monitor.stats)
        elif not wanted:
            self._remove_gradient_hooks()
            self.gradient_sums.expect(0)
        if self.activations is not None:
            self.activations.follow(self.running and self.collecting)

    def detach_capabilities(self) -> None:
        for handle in self._capability_handles:
            handle.remove()
        self._capability_handles = []
        self.running = self.collecting = False
        if self.at is not None:
            self._follow_collection()
        for hooks in (self.activations, self.struct, self.stacks):
            if hooks is not None:
                hooks.detach()
        self.activations = self.struct = self.stacks = None
        self.hooked_cells = 0
        self.gradient_sums.release()

    def reattach(self, at: Attachment, config: TensorStatsConfig) -> None:
        """Before training: attached again, to another optimizer (kj600 gives it after hook_modules), with
        the configuration that needed it."""
        self.detach()
        self.config = config
        self.attach(at, self.step)

    def detach(self) -> None:
        """Every hook off: the optimizer and the parameters are as before `attach`."""
        if self.at is not None:
            self.detach_capabilities()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _remove_gradient_hooks(self) -> None:
        for handle in self._gradient_handles:
            handle.remove()
        self._gradient_handles = []

    def _closer(self) -> Optional[int]:
        """The parameter whose hook ends a micro-batch (see GradientSums), where the other hooks can be
        appends (MindSpore 2.7 takes Python functions and methods only: every hook is Python there)."""
        sums = self.gradient_sums
        return sums.closer if sums.appends and builtin_hooks_accepted() else None

    def _gradient_hook(self, index: int, name: str):
        closer = self._hooked_closer
        if closer is not None:
            return self.gradient_sums.append_hook(index, name) if index != closer else self._close_micro_batch
        add = self.gradient_sums.add

        def hook(grad):   # `_guard` written out: one Python frame fewer in each of the step's many calls
            if self.collecting:
                try:
                    add(index, name, grad)
                except Exception as error:  # noqa: BLE001 - the training must not die of its monitor
                    self._switch_off(error)
        return hook

    def _close_micro_batch(self, grad) -> None:
        if self.collecting:
            try:
                self.gradient_sums.close(self._hooked_closer, grad)
            except Exception as error:  # noqa: BLE001 - the training must not die of its monitor
                self._switch_off(error)

    def _record_micro_gradient(self, name: str, grad, micro_step: int) -> None:
        self.recorder.record(GRAD_UNREDUCED, [(name, grad)], {"micro_step": micro_step})

    def _record_activations(self, point: str, named_tensors, micro_step: int) -> None:
        self.recorder.record(point, named_tensors, {"micro_step": micro_step})

    # --- one step -------------------------------------------------------------------------------------

    def _before_update(self, cell, inputs) -> None:
        if self.collecting:
            self._guard(self._record_before_update, inputs)

    def _after_update(self, cell, inputs, output) -> None:
        if self.collecting:
            self._guard(self._finish_step)
        if self.failed:
            self.detach_capabilities()
        self._end_step_hooks()
        self.step += 1
        self.gradient_sums.clear()
        self.micro_steps.end_step()
        if self.struct is not None:
            self._stop_after_structure()
        self._next_configuration()
        self.collecting = self.running and self.config.collects(self.step)
        self._follow_collection()

    def end_pending_step(self) -> None:
        """Without an optimizer the last step's end is known only when the front door closes."""
        if self.at is not None and self.at.optimizer is None and self.micro_steps.forwards:
            self._end_step_without_optimizer()

    def _end_step_by_forwards(self) -> None:
        """Without an optimizer (kj600's hook_modules): a step ends when the model starts its forward
        number grad_acc_steps + 1."""
        if self.micro_steps.forwards == self.at.grad_acc_steps:
            self._end_step_without_optimizer()

    def _end_step_without_optimizer(self) -> None:
        self._before_update(None, ())   # the step's summed gradients (kj600 hooks them without an optimizer)
        self._after_update(None, (), None)

    def _end_step_hooks(self) -> None:
        if self.activations is not None:
            self.activations.end_step()
        if self.stacks is not None and self.stacks.stacks:
            self._guard(self.stacks.write, self.run_folder())
            self.stacks.detach()
            self.stacks = None

    def _stop_after_structure(self) -> None:
        struct = self.struct
        path = struct.write(csv_output_root(), self.rank)
        self.detach()
        message = (f"mindmon: print_struct: the structure of {len(struct.struct)} cells is in {path}; "
                   f"training stops after step 1 as print_struct asks (set it to false to train)")
        logger.warning(message)
        raise StopTraining(message)

    def _next_configuration(self) -> None:
        """Dynamic mode: an edited config.json applies from the next step. Both modes: every capability
        hook is detached once collect_times is reached (dynamic mode also writes dynamic_on: false)."""
        if self.watcher is not None:
            config = self.watcher.poll(self.step - 1)
            if config is not None and not config.dynamic_on:
                if self.running:
                    logger.info("mindmon: DYNAMIC_MONITOR: dynamic_on is false; monitoring stops after step %d",
                                self.step - 1)
                self.detach_capabilities()
                return
            if config is not None:
                self.switch_to(dataclasses.replace(config, start_step=self.step))
        if self.running and self.config.finished(self.step):
            logger.info("mindmon: TrainerMon reached collect_times (%d) before step %d; its hooks are detached",
                        self.config.collect_times, self.step)
            self.detach_capabilities()
            if self.watcher is not None:
                self.watcher.switch_off()

    def switch_to(self, config: TensorStatsConfig) -> None:
        """The new configuration's hooks replace the running ones; one it cannot apply leaves them."""
        try:
            plan = self.plan(config)
        except ConfigError as error:
            logger.error("mindmon: the configuration changed at step %d but %s; the running configuration stays",
                         self.step, error)
            return
        logger.info("mindmon: configuration updated; collecting by it from step %d", self.step)
        self._apply(config, plan)

    def _record_before_update(self, inputs) -> None:
        config, monitor, parameters = self.config, self.recorder, self.at.parameters
        if config.param_distribution:
            monitor.record(PARAM_ORIGIN, [(name, parameters[i]) for i, name in self.selected])
        if config.wg_distribution:
            monitor.record(GRAD_UNREDUCED, self.gradient_sums.for_recording(self.monitor.stats))
        if config.wg_distribution and self.at.optimizer is not None:   # without one, nothing is reduced for it
            monitor.record(GRAD_REDUCED, self._reduced_gradients(inputs))
        if self.moments is not None:
            first, second = self.moments
            monitor.record(EXP_AVG, [(name, first[i]) for i, name in self.selected])
            monitor.record(EXP_AVG_SQ, [(name, second[i]) for i, name in self.selected])
        if self.adam is not None:
            self.adam.record(monitor, self.step, self._gradients_passed(inputs), config.ur_distribution,
                             config.mg_direction)

    def _finish_step(self) -> None:
        if self.config.param_distribution:
            self.recorder.record(PARAM_UPDATED, [(name, self.at.parameters[i]) for i, name in self.selected])
        if self.config.wg_distribution:
            self.gradient_sums.check_count(self.at.grad_acc_steps, self.step)
        if self.on_step_end is not None:
            self.on_step_end(self.step + 1)  # records count steps from 1; the CSV writes step 0

    def _reduced_gradients(self, inputs) -> List[tuple]:
        return [(name, grad) for i, name, grad in self._gradients_passed(inputs) if self.keep_grads[i]]

    def _gradients_passed(self, inputs) -> List[tuple]:
        """(index, name, gradient) the optimizer gets: the tuple passed to its call, else each parameter's
        `main_grad` (when params_have_main_grad) or `grad`."""
        passed = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)) else None
        if passed is not None and len(passed) == len(self.at.parameters):
            return [(i, name, passed[i]) for i, name in self.selected]
        return self.stored_gradients()

    def stored_gradients(self) -> List[tuple]:
        """(index, name, gradient) of the selected parameters that hold one in `main_grad`/`grad`."""
        found, missing = [], []
        for index, name in self.selected:
            param = self.at.parameters[index]
            grad = getattr(param, "main_grad", None) if self.params_have_main_grad else None
            grad = grad if grad is not None else getattr(param, "grad", None)
            (found if grad is not None else missing).append((index, name, grad))
        if missing:
            self._warn_once("missing_grad", "mindmon: no gradient for %s: neither passed to the optimizer call nor "
                            "in main_grad/grad; their grad_reduced rows are left out", [n for _, n, _ in missing])
        return found

    # --- the current step's numbers, on request (msprobe's generate_*_metrics) ----------------------

    def gradient_tables(self) -> Dict[str, Dict[str, dict]]:
        """{grad_reduced / grad_unreduced: {parameter: {op: value}}} of the gradients now."""
        calculator = TensorStatsMonitor(self.monitor.ops, self.config.eps, self.on_host, self.rank)
        calculator.record(GRAD_REDUCED, [(name, grad) for _, name, grad in self.stored_gradients()])
        calculator.record(GRAD_UNREDUCED, self.gradient_sums.named_sums())
        tables: Dict[str, Dict[str, dict]] = {GRAD_REDUCED: {}, GRAD_UNREDUCED: {}}
        for record in calculator.collect(self.step + 1):
            tables[record.kind][record.name] = dict(zip(record.ops, record.value))
        return tables

    def activation_tables(self) -> Dict[str, Dict[str, dict]]:
        """{actv / actv_grad: {row: {op: value}}} collected so far in this step (a row's latest values)."""
        tables: Dict[str, Dict[str, dict]] = {ACTV: {}, ACTV_GRAD: {}}
        for entry in self.monitor.stats.results():
            if entry.point in tables:
                tables[entry.point].update((name, dict(zip(entry.ops, row)))
                                           for name, row in zip(entry.names, entry.values.tolist()))
        return tables

    # --- failures -------------------------------------------------------------------------------------

    def _guard(self, function, *args):
        """`function(*args)`, or None if it fails: a hook that fails switches its monitor off by the group's
        one policy (logged once, training goes on, what was written stays); the hooks stop collecting now
        and are detached at the step's end."""
        try:
            return function(*args)
        except Exception as error:  # noqa: BLE001 - the training must not die of its monitor
            self._switch_off(error)
            return None

    def _switch_off(self, error: Exception) -> None:
        self.collecting = self.running = False
        self.failed = True
        self.monitor.reset()
        self.recorder.switch_off(self.monitor, error)

    def _warn_once(self, key, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


def attachment(model, grad_acc_steps: int, optimizer, dp_group=None, tp_group=None,
               parameters_without_optimizer: Sequence = ()) -> Attachment:
    """The parameters are the optimizer's; without one, those the front door names (kj600: the model's)."""
    parameters = optimizer_parameters(optimizer) if optimizer is not None else tuple(parameters_without_optimizer)
    return Attachment(model, grad_acc_steps, optimizer, parameters, dp_group, tp_group)


def _moments(config: TensorStatsConfig, optimizer, count: int):
    if not config.mv_distribution:
        return None
    moments = find_moments(optimizer, count)
    if moments is None:
        raise ConfigError(f"mv_distribution: got True, but the optimizer {type(optimizer).__name__} keeps no "
                          f"Adam moments; allowed: an Adam-type optimizer (nn.Adam, nn.AdamWeightDecay, "
                          f"mindspore.experimental.optim.Adam/AdamW, MindFormers AdamW) or "
                          f"mv_distribution: false")
    return moments


def keeps_reduced_gradients(dp_group, tp_group, parameters: Sequence, selected: Sequence[Tuple[int, str]]
                            ) -> Dict[int, bool]:
    """Per parameter index: is this rank's grad_reduced row kept? After the data-parallel reduction every
    rank of `dp_group` holds the same gradients, so only its first rank writes them; in `tp_group` the
    parameters not split across ranks (no `tensor_model_parallel` attribute) are written by its first rank."""
    first_in_dp = dp_group is None or DataParallel(dp_group).rank == 0
    first_in_tp = tp_group is None or DataParallel(tp_group).rank == 0
    return {i: first_in_dp and (first_in_tp or bool(getattr(parameters[i], "tensor_model_parallel", False)))
            for i, _ in selected}
