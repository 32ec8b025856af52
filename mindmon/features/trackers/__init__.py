"""`monitor.trackers`: the run's values in experiment trackers (MLflow, SwanLab offline or local, W&B
offline) and on a Prometheus endpoint, all from rank 0 (docs/trackers.md). A tracker that fails is switched
off with one line and training goes on."""
import os

from mindmon.core.engine import Feature
from mindmon.features.trackers.config import PATH, TrackersConfig


def build(build, section: TrackersConfig) -> None:
    """Rank 0 only: it has the cross-rank summaries, and one run per experiment is what trackers show."""
    if not section.active or build.rank != 0:
        return
    output_dir = build.config.monitor.output_dir
    params = build.config.to_dict()
    if section.mlflow is not None:
        from mindmon.features.trackers.mlflow_sink import MlflowSink

        build.sinks.append(MlflowSink(section.mlflow, params, output_dir, build.logger))
    if section.swanlab is not None:
        from mindmon.features.trackers.swanlab_sink import SwanlabSink

        log_dir = section.swanlab.log_dir or os.path.join(output_dir, "swanlog")
        build.sinks.append(SwanlabSink(section.swanlab, params, log_dir, build.logger))
    if section.wandb is not None:
        from mindmon.features.trackers.wandb_sink import WandbSink

        build.sinks.append(WandbSink(section.wandb, params, section.wandb.dir or output_dir, build.logger))
    trackers = list(build.sinks)
    if trackers:
        from mindmon.features.trackers.backlog import TrackerBacklogMonitor

        build.add_monitor(TrackerBacklogMonitor(build.rank, trackers))
    if section.prometheus is not None:
        from mindmon.features.trackers.prometheus import PrometheusSink

        build.sinks.append(PrometheusSink(section.prometheus, output_dir, build.logger))


FEATURE = Feature("trackers", PATH, parse=TrackersConfig.parse, build=build,
                  example={"monitor": {"trackers": {"prometheus": {"port": 0, "addr": "127.0.0.1"}}}})
