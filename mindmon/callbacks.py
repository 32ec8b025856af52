"""Training callbacks with the MindFormers TrainerCallback events, and `ModelMonitorCallback` for
`mindspore.train.Model` (loaded on first use: importing this module does not import MindSpore).

They live in `mindmon.callbacks`, not in a top-level `callbacks` module, because many training
repositories have a `callbacks.py` of their own next to the launch script, which would shadow it.
"""
from mindmon.features.max_logits.callback import MaxLogitsMonitor
from mindmon.features.profiler.callback import ProfilerCallback
from mindmon.core.trainer_callbacks import MonitorCallback, TrainerCallback

# ModelMonitorCallback is given by __getattr__ below: importing it imports MindSpore.
__all__ = ["MaxLogitsMonitor", "ModelMonitorCallback",  # noqa: F822
           "MonitorCallback", "ProfilerCallback", "TrainerCallback"]


def __getattr__(name):
    if name == "ModelMonitorCallback":
        from mindmon.loop.model_callback import ModelMonitorCallback

        return ModelMonitorCallback
    raise AttributeError(f"module 'mindmon.callbacks' has no attribute {name!r}")
