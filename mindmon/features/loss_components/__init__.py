"""`monitor.loss_components`: the parts of the model's loss (language model, load balancing, z-loss, MTP),
per micro-batch and per step, with Megatron's TensorBoard names."""
from mindmon.core.engine import Feature
from mindmon.features.loss_components.config import LossComponentsConfig


def build(build, section: LossComponentsConfig) -> None:
    if not section.active:
        return
    if build.collects:
        from mindmon.features.loss_components.monitor import LossComponentsMonitor

        build.add_monitor(LossComponentsMonitor(build.model, build.rank, section.max_components, build.cross_rank))
    from mindmon.features.loss_components.tags import with_component_tags

    previous = build.tensorboard_tags   # another feature's own tags (monitor_config's), kept underneath
    build.tensorboard_tags = lambda default: with_component_tags(previous(default) if previous else default)


FEATURE = Feature("loss_components", "monitor.loss_components", parse=LossComponentsConfig.parse, build=build,
                  example={"monitor": {"loss_components": {"enabled": True}}})
