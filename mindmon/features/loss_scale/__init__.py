"""`monitor.loss_scale`: the loss scale of mixed-precision training, overflowed steps and skipped updates."""
from mindmon.core.engine import Feature
from mindmon.features.loss_scale.config import LossScaleConfig


def build(build, section: LossScaleConfig) -> None:
    if section.active and build.collects:
        from mindmon.features.loss_scale.monitor import LossScaleMonitor

        build.add_monitor(LossScaleMonitor(build.rank))


FEATURE = Feature("loss_scale", "monitor.loss_scale", parse=LossScaleConfig.parse, build=build,
                  example={"monitor": {"loss_scale": {"enabled": True}}})
