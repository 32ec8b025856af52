"""`monitor.across_ranks`: rank 0 writes per-step min, mean, max over the data-parallel ranks (and the ranks
of the extremes) of every rank's losses, gradient norms and tokens per expert, carried in the step's own
collectives (docs/multi-rank.md, "Cross-rank summaries, live"); under tensor or context parallelism, over
the data-parallel replicas, of full parameters (docs/model-parallel.md)."""
from mindmon.config import ConfigError
from mindmon.core.engine import Feature
from mindmon.features.across_ranks.config import AcrossRanksConfig

PATH = "monitor.across_ranks"


def build(build, section: AcrossRanksConfig) -> None:
    if not section.active or not build.collects:
        return
    if build.data_parallel.active and build.config.monitor.ranks is not None:
        raise ConfigError(f"{PATH}.enabled: true needs every data-parallel rank in the all-reduce, but "
                          f"monitor.ranks is {list(build.config.monitor.ranks)}; allowed: monitor.ranks unset")
    layout = build.layout if build.layout is not None and build.layout.model_parallel else None
    split = [f"{axis}={layout.size(axis)}" for axis in ("pp", "ep") if layout is not None and layout.size(axis) > 1]
    if split:
        raise ConfigError(f"{PATH}.enabled: true with {', '.join(split)} (a replica's parameters or experts "
                          f"spread over those ranks are not summed by it); allowed: data, tensor and context "
                          f"parallelism")
    from mindmon.features.across_ranks.monitor import AcrossRanksMonitor

    moe = build.parts.get("moe_monitor")
    train_state = build.config.monitor.sections.get("train_state")
    monitor = AcrossRanksMonitor(train_state if train_state is not None and train_state.active else None,
                                 build.parameter_names, build.data_parallel, build.on_host, moe, build.rank,
                                 layout)
    if not monitor.summarises:
        raise ConfigError(f"{PATH}.enabled: true, but neither monitor.train_state nor monitor.moe_monitor "
                          f"collects a per-rank value to summarise; allowed: with either of them on")
    build.add_monitor(monitor)


FEATURE = Feature("across_ranks", PATH, parse=AcrossRanksConfig.parse, build=build,
                  example={"monitor": {"train_state": {"local_norm": True, "local_loss": True, "device_loss": True},
                                       "across_ranks": {"enabled": True}}})
