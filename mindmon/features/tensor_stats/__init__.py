"""Tensor statistics (msprobe's monitor): weights, gradients, optimizer state and activations, with the
L2 features and collectives that share its config.json, in msprobe's CSV. `monitor.tensor_stats` on the
YAML route; msprobe's and kj600's `TrainerMon` are front doors onto the same parts."""
import functools
import os

from mindmon.core.engine import Feature
from mindmon.features.tensor_stats.config import TensorStatsConfig, parse_tensor_stats

CSV_FOLDER = "tensor_stats"   # the YAML route's msprobe run folders go under <output_dir>/tensor_stats/


def wanted(section: TensorStatsConfig, rank: int) -> bool:
    """Its hooks and monitors are built: switched on for this rank, or ready for config.json to switch
    them on while training (dynamic mode)."""
    from mindmon.features.tensor_stats.dynamic import dynamic_mode

    return section is not None and ((section.active and section.selects_rank(rank)) or dynamic_mode())


def build(build, section: TensorStatsConfig) -> None:
    """Its statistics monitor, the L2 and collectives monitors when their keys ask for them, the CSV sink
    (the YAML route's; a front door hands in its own) and, in `parts`, a maker of its hooks
    (mindmon.features.tensor_stats.hooks.TensorStatsHooks) for the front door to attach."""
    if not (section.active or wanted(section, build.rank)):
        return
    csv = None
    if build.own_outputs and section.writes_csv:
        from mindmon.features.tensor_stats.sink import MsprobeCsvSink

        csv = MsprobeCsvSink.for_config(section, os.path.join(build.config.monitor.output_dir, CSV_FOLDER))
        build.sinks.append(csv)
    if not (build.collects and wanted(section, build.rank)):
        return
    monitors = _monitors(section, build)
    for monitor in monitors:
        if monitor is not None:
            build.add_monitor(monitor)
    from mindmon.features.tensor_stats.hooks import TensorStatsHooks

    stats, l2, cc, optimizer_state = monitors
    build.parts["tensor_stats"] = functools.partial(TensorStatsHooks, config=section, monitor=stats, l2_monitor=l2,
                                                    cc_monitor=cc, optimizer_state_monitor=optimizer_state,
                                                    csv_sink=csv, rank=build.rank, on_host=build.on_host)


def _monitors(section: TensorStatsConfig, build) -> tuple:
    """(statistics, L2 features or None, collectives or None, optimizer state or None)."""
    from mindmon.features.tensor_stats.dynamic import dynamic_mode
    from mindmon.features.tensor_stats.monitor import TensorStatsMonitor

    stats = TensorStatsMonitor(section.ops, section.eps, build.on_host, build.rank)
    l2 = cc = None
    if dynamic_mode() or (section.l2 is not None and section.l2.active):
        from mindmon.features.l2.monitor import L2FeaturesMonitor

        l2_config = section.l2
        l2 = L2FeaturesMonitor(l2_config.sa_order if l2_config else "s,b,h,d",
                               l2_config.causal if l2_config else True, build.on_host, build.rank)
    if dynamic_mode() or (section.cc is not None and section.cc.active and not section.cc.log_only):
        from mindmon.features.collectives.hooks import CollectiveStatsMonitor

        cc = CollectiveStatsMonitor(section.ops, section.eps, build.on_host, build.rank)
    optimizer_state = None
    if dynamic_mode() or section.reads_adam_state:
        from mindmon.features.tensor_stats.optimizer_state import OptimizerStateMonitor

        optimizer_state = OptimizerStateMonitor(section.ops, section.eps, True, build.rank)
    return stats, l2, cc, optimizer_state


FEATURE = Feature("tensor_stats", "monitor.tensor_stats", parse=TensorStatsConfig.parse, build=build,
                  example={"monitor": {"tensor_stats": {"wg_distribution": True, "param_distribution": True,
                                                        "ops": ["norm", "min"]}}})
__all__ = ["CSV_FOLDER", "FEATURE", "TensorStatsConfig", "parse_tensor_stats"]
