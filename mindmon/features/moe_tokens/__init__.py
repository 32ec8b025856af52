"""`monitor.moe_monitor`: tokens per expert of every MoE layer, and Megatron's tokens-per-expert file."""
from mindmon.config import ConfigError
from mindmon.core.engine import Feature
from mindmon.features.moe_tokens.config import MoEMonitorConfig


def build(build, section: MoEMonitorConfig) -> None:
    if not section.active:
        return
    if build.collects:
        if build.model is None:
            raise ConfigError("monitor.moe_monitor: save_tokens_per_expert_interval is set but no model was "
                              "given; pass model= so its MoE layers can be found")
        from mindmon.features.moe_tokens.monitor import MoETokensMonitor

        monitor = MoETokensMonitor(section, build.model, build.rank, build.on_host, build.logger,
                                   build.cross_rank, build.layout)
        build.add_monitor(monitor)
        build.parts["moe_monitor"] = monitor   # monitor.across_ranks reads each rank's step tokens from it
    if build.own_outputs:
        from mindmon.features.moe_tokens.sink import MegatronTokensPerExpertSink

        build.sinks.append(MegatronTokensPerExpertSink(build.config.monitor.output_dir))


FEATURE = Feature("moe_monitor", "monitor.moe_monitor", parse=MoEMonitorConfig.parse, build=build,
                  example={"monitor": {"moe_monitor": {"save_tokens_per_expert_interval": 1}}})
