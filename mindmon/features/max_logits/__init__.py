"""Max attention logit per head (`MaxLogitsMonitor` in `callbacks:`): the model's running max, reset
every step, printed every `step_interval` steps."""
from mindmon.core.engine import Feature
from mindmon.features.max_logits.config import MAX_LOGITS_CALLBACK, MaxLogitsSection


def build(build, section: MaxLogitsSection) -> None:
    if section.active and build.collects and build.model is not None:
        from mindmon.features.max_logits.monitor import MaxAttentionLogitMonitor

        build.add_monitor(MaxAttentionLogitMonitor(build.model, section.step_interval, build.rank,
                                                   build.data_parallel if build.cross_rank else None, build.logger,
                                                   build.layout, section.enable_logging))


FEATURE = Feature("max_logits", "callbacks", parse=MaxLogitsSection.parse, build=build,
                  example={"callbacks": [{"type": MAX_LOGITS_CALLBACK, "step_interval": 1}]})
__all__ = ["FEATURE", "MAX_LOGITS_CALLBACK", "MaxLogitsSection"]
