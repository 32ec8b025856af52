"""`monitor.train_state`: per-parameter gradient norms and losses per micro-step and per step."""
from mindmon.core.engine import Feature
from mindmon.features.train_state.config import TrainStateConfig


def build(build, section: TrainStateConfig) -> None:
    if section.active and build.collects:
        from mindmon.features.train_state.monitor import TrainStateMonitor

        build.add_monitor(TrainStateMonitor(section, build.parameter_names, build.rank, build.on_host,
                                            layout=build.layout))


FEATURE = Feature("train_state", "monitor.train_state", parse=TrainStateConfig.parse, build=build,
                  example={"monitor": {"train_state": {"local_norm": True, "local_loss": True,
                                                       "device_norm": True, "device_loss": True}}})
