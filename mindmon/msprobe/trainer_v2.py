"""`TrainerMonitorV2`: msprobe's monitor_v2 API on MindSpore, translated onto mindmon's tensor statistics.

    from mindmon.msprobe import TrainerMonitorV2     # was: from msprobe.core.monitor_v2 import TrainerMonitorV2
    monitor = TrainerMonitorV2("./monitor_v2.json", fr="mindspore")
    monitor.start(model=model, optimizer=optimizer)
    for step in range(steps):
        ...                    # forward, backward, optimizer(grads)
        monitor.step()
    monitor.stop()

The config (mindmon/msprobe/v2_config.py) becomes a `monitor.tensor_stats` section, the factory assembles
the group with monitor_v2's CSV (mindmon/msprobe/v2_csv.py) as its output, and the feature's hooks attach
to the model and this optimizer instance. A step ends at the optimizer's call (MindSpore optimizers have
no `step()` for msprobe to patch); without an optimizer, at `step()`.
"""
import logging
from typing import Any, Dict, List, Optional, Tuple

from mindmon.compat import named_cells
from mindmon.config import ConfigError, MindmonConfig, MonitorConfig
from mindmon.parallel.data_parallel import DataParallel
from mindmon.features.tensor_stats.config import parse_tensor_stats
from mindmon.features.tensor_stats.hooks import attachment
from mindmon.features.tensor_stats.points import EXP_AVG, EXP_AVG_SQ
from mindmon.features.tensor_stats.targets import find_moments, optimizer_parameters
from mindmon.msprobe.v2_config import ConfigV2, load_config_v2
from mindmon.msprobe.v2_csv import MonitorV2CsvSink

logger = logging.getLogger("mindmon")

NEEDS_OPTIMIZER = ("weight_grad", "optimizer", "param")
# Without an optimizer a step ends at step(), never by counting the model's forwards.
NO_FORWARD_COUNT = 1 << 62


class TrainerMonitorV2:
    """msprobe's `TrainerMonitorV2` (MindSpore): `start(model=, optimizer=)`, `step()`, `stop()`."""

    def __init__(self, config_path: str, fr: Optional[str] = None) -> None:
        self.config_path = config_path
        self.config: ConfigV2 = load_config_v2(config_path, fr)
        self.framework = self.config.framework
        self.rank = DataParallel().rank
        self.current_step = 0
        self.output_dir = self.config.output_dir
        self.group = None
        self.hooks = None
        self.moments: Optional[Tuple[Any, Any]] = None
        self._by_optimizer = False
        self._warned_manual_step = False
        if self.config.async_write:
            logger.info("mindmon: monitor_v2 async_write: rows are written at each step's end either way")

    # --- msprobe's API ------------------------------------------------------------------------------

    def start(self, model: Any = None, optimizer: Any = None, **context: Any) -> None:
        """Attach to `model`'s cells and this optimizer instance; checks everything before training.
        `context` may give `grad_acc_steps` (or `micro_batch_number`), as in msprobe."""
        config = self.config
        if not config.selects_rank(self.rank) or self.hooks is not None:
            return
        self._check_start(model, optimizer)
        if config.collected_steps == 0 or not config.monitors:
            logger.info("mindmon: TrainerMonitorV2 collects nothing (no monitor enabled, or an empty step window)")
            return
        sections = translate(config, model, optimizer, self.rank)
        if not sections["tensor_stats"].active:
            logger.info("mindmon: TrainerMonitorV2 collects nothing on rank %d (monitors.cc.module_ranks)", self.rank)
            return
        grad_acc_steps = self._grad_acc_steps(context)
        patch = config.patch_optimizer_step
        self._by_optimizer = optimizer is not None
        if optimizer is not None and patch is False:
            logger.info("mindmon: TrainerMonitorV2: patch_optimizer_step is false; a step still ends at the "
                        "optimizer's call (where its gradients and parameters are read), step() only counts")
        sink = MonitorV2CsvSink(config.output_dir, self.rank, {n: m.ops for n, m in config.monitors.items()},
                                grad_acc_steps, config.start_step, config.step_count_per_record)
        from mindmon.core.factory import assemble

        run = assemble(MindmonConfig(MonitorConfig(output_dir=config.output_dir, sections=sections)), rank=self.rank,
                       logger=logger, parameter_names=(), outputs=[sink], data_parallel=DataParallel())
        self.group = run.group
        hooks = run.tensor_stats_hooks(config=sections["tensor_stats"], run_folder=lambda: sink.rank_dir,
                                       watcher=None, on_step_end=self._step_end, params_have_main_grad=False)
        at = attachment(model, grad_acc_steps if optimizer is not None else NO_FORWARD_COUNT, optimizer)
        try:
            hooks.attach(at, 0)
            if "optimizer" in config.monitors:
                self.moments = self._moments(optimizer, at.parameters)
        except BaseException:   # a refused configuration leaves nothing attached and no files open
            hooks.detach()
            self.group.close()
            self.group = None
            raise
        self.hooks = hooks

    def step(self, from_optimizer: bool = False) -> None:
        """The end of a training step. With an optimizer the step already ended at its call: counted only."""
        if self.hooks is None:
            self.current_step += 1
            return
        if self._by_optimizer:
            if self.config.patch_optimizer_step is not False and not self._warned_manual_step:
                logger.info("mindmon: TrainerMonitorV2: the step ended at the optimizer's call; step() counts it")
                self._warned_manual_step = True
            self.current_step += 1
            return
        self.hooks.end_pending_step()
        self.current_step += 1

    def stop(self) -> None:
        """Detach every hook and close the files."""
        if self.hooks is not None:
            self.hooks.detach()
            self.hooks = None
        if self.group is not None:
            self.group.close()
            self.group = None

    # --- mindmon's side -----------------------------------------------------------------------------

    def _check_start(self, model, optimizer) -> None:
        if model is None:
            raise ConfigError("start: model is None; allowed: the model (a mindspore.nn.Cell) or a list of chunks")
        needing = [name for name in NEEDS_OPTIMIZER if name in self.config.monitors]
        if needing and optimizer is None:
            raise ConfigError(f"monitors.{needing[0]}: enabled, but start() got no optimizer; allowed: "
                              f"start(model=..., optimizer=...) or monitors.{needing[0]}.enabled: false")

    def _grad_acc_steps(self, context: Dict[str, Any]) -> int:
        """msprobe's micro-batch count: weight_grad's micro_batch_number / grad_acc_steps, else start()'s."""
        options = self.config.monitors["weight_grad"].options if "weight_grad" in self.config.monitors else {}
        for value in (options.get("micro_batch_number"), options.get("grad_acc_steps"),
                      context.get("micro_batch_number"), context.get("grad_acc_steps")):
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return 1

    def _moments(self, optimizer, parameters) -> Tuple[Any, Any]:
        moments = find_moments(optimizer, len(parameters))
        if moments is None:
            raise ConfigError(f"monitors.optimizer: enabled, but the optimizer {type(optimizer).__name__} keeps no "
                              f"Adam moments; allowed: an Adam-type optimizer (nn.Adam, nn.AdamWeightDecay, "
                              f"mindspore.experimental.optim.Adam/AdamW) or monitors.optimizer.enabled: false")
        return moments

    def _step_end(self, step: int) -> None:
        """The step's rows to the files; monitor_v2 reads Adam's moments here, after the update."""
        if self.moments is not None:
            first, second = self.moments
            self.group.record(EXP_AVG, [(name, first[i]) for i, name in self.hooks.selected])
            self.group.record(EXP_AVG_SQ, [(name, second[i]) for i, name in self.hooks.selected])
        self.group.flush(step)


def translate(config: ConfigV2, model, optimizer, rank: int = 0) -> Dict[str, Any]:
    """monitor_v2's monitors as a `monitor.tensor_stats` section: one engine, the union of the monitors'
    ops (each file writes its monitor's own), every optimizer parameter for weight_grad and param, the
    cells whose names hold a module target keyword for module, the collectives' wrappers for cc (on the
    ranks of its module_ranks)."""
    monitors = config.monitors
    eps_values = {m.eps for m in monitors.values()}
    if len(eps_values) > 1:
        raise ConfigError(f"monitors.*.eps: got {sorted(eps_values)}; allowed: one eps for every monitor "
                          f"(mindmon takes every statistic in one pass)")
    ops: List[str] = list(dict.fromkeys(op for m in monitors.values() for op in m.ops))
    section: Dict[str, Any] = {"ops": ops, "eps": eps_values.pop(), "start_step": config.start_step,
                               "step_interval": config.step_interval, "collect_times": config.collected_steps}
    if "param" in monitors:
        section["param_distribution"] = monitors["param"].options.get("param_distribution", True)
    if "weight_grad" in monitors:
        section["wg_distribution"] = True
        section["monitor_mbs_grad"] = monitors["weight_grad"].options.get("monitor_mbs_grad", False)
    if "module" in monitors:
        section["xy_distribution"] = True
        section["targets"] = module_targets(monitors["module"].options["targets"], model, optimizer)
    cc = monitors.get("cc")
    if cc is not None and (not cc.options["module_ranks"] or rank in cc.options["module_ranks"]):
        section["cc_distribution"] = {"enable": True, "cc_codeline": list(cc.options["cc_codeline"]),
                                      "cc_pre_hook": cc.options.get("cc_pre_hook", False),
                                      "cc_log_only": cc.options.get("cc_log_only", False)}
    return {"tensor_stats": parse_tensor_stats(section, "monitors")}


def module_targets(keywords: Tuple[str, ...], model, optimizer) -> Dict[str, dict]:
    """mindmon's targets for monitor_v2's module keywords (a cell is watched when its name holds one):
    the matching cells, and every optimizer parameter by name (monitor_v2's weight_grad and param watch
    them all, whatever the module targets). No keywords: {} (every cell and parameter)."""
    if not keywords:
        return {}
    cells = [name for name, _ in named_cells(model) if name and any(k in name for k in keywords)]
    if not cells:
        examples = [name for name, _ in list(named_cells(model))[1:5]]
        raise ConfigError(f"monitors.module.targets: got {list(keywords)}, which no cell name holds; allowed: "
                          f"keywords of cell names such as {examples}")
    parameters = [p.name for p in optimizer_parameters(optimizer)] if optimizer is not None else []
    return {name: {} for name in cells + parameters}
