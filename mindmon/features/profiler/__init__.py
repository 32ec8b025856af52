"""The `profiler` section: MindSpore's profiler over a window of global steps."""
from mindmon.core.engine import Feature
from mindmon.features.profiler.config import ProfilerConfig


def callbacks(group, section: ProfilerConfig, logger) -> list:
    if not (section.enable_profiling and section.selects_rank(group.rank)):
        return []
    from mindmon.features.profiler.callback import ProfilerCallback

    return [ProfilerCallback(section, group.rank, logger)]


FEATURE = Feature("profiler", "profiler", parse=ProfilerConfig.parse, callbacks=callbacks,
                  example={"profiler": {"enable_profiling": True, "start_step": 1, "end_step": 1}})
