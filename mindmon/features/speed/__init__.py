"""`monitor.speed`: step and phase times, throughput, memory, and the slow rank across the data-parallel
ranks (docs/speed.md)."""
from mindmon.core.engine import Feature
from mindmon.features.speed.config import PATH, SpeedConfig


def build(build, section: SpeedConfig) -> None:
    if not section.active or not build.collects:
        return
    from mindmon.features.speed.monitor import SpeedMonitor

    counter, peak, routed = _flop_parts(build, section) if section.flops else (None, None, None)
    build.add_monitor(SpeedMonitor(build.rank, build.data_parallel if build.cross_rank else None,
                                   build.global_batch_size, section.slow_rank_factor, flops=counter,
                                   peak_flops_per_second=peak, routed=routed, throughput_drop=section.throughput_drop,
                                   layout=build.layout))


def _flop_parts(build, section: SpeedConfig):
    """The FLOP counter on the model (with what the model declares of its attention and experts through
    `flop_counting()`), the peak FLOP/s of the device for the parameters' dtype (None: no MFU, said once),
    and the MoE monitor's routed counts when it runs."""
    from mindmon.config import ConfigError
    from mindmon.features.speed.flops import FlopCounter
    from mindmon.features.speed.peaks import PeakFinder, detect_device

    if build.model is None:
        raise ConfigError(f"{PATH}.flops: true needs the model (model=...) to count its matmuls; allowed: false, "
                          f"or give the model")
    declared = getattr(build.model, "flop_counting", None)
    specs = declared() if callable(declared) else {}
    counter = FlopCounter(build.model, specs.get("attention"), specs.get("experts"), build.logger)
    dtypes = [p.dtype for p in build.model.trainable_params()]
    peak = PeakFinder(build.logger).find(detect_device(), dtypes[0] if dtypes else None, section.peak_tflops)
    if peak.flops_per_second is not None:
        build.logger.info(f"mindmon: MFU against {peak.flops_per_second / 1e12:g} TFLOP/s ({peak.source})")
    return counter, peak.flops_per_second, _routed_counts(build.parts.get("moe_monitor"))


def _routed_counts(moe):
    """{the MoE layer's cell name: this rank's tokens per expert of the step} from the MoE monitor."""
    if moe is None:
        return None

    def read():
        tokens = moe.step_tokens()
        if tokens is None:
            return None
        tokens = tokens if hasattr(tokens, "shape") and not hasattr(tokens, "asnumpy") else tokens.asnumpy()
        return {layer.module: [int(v) for v in row] for layer, row in zip(moe.layers, tokens)}
    return read


FEATURE = Feature("speed", PATH, parse=SpeedConfig.parse, build=build,
                  example={"monitor": {"speed": {"enabled": True}}})
