"""`monitor.speed`: step and phase times, throughput, memory, and the slow rank across the data-parallel
ranks (docs/speed.md)."""
from mindmon.engine import Feature
from mindmon.features.speed.config import PATH, SpeedConfig


def build(build, section: SpeedConfig) -> None:
    if not section.active or not build.collects:
        return
    from mindmon.features.speed.monitor import SpeedMonitor

    build.add_monitor(SpeedMonitor(build.rank, build.data_parallel if build.cross_rank else None,
                                   build.global_batch_size, section.slow_rank_factor))


FEATURE = Feature("speed", PATH, parse=SpeedConfig.parse, build=build,
                  example={"monitor": {"speed": {"enabled": True}}})
