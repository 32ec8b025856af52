"""Training callbacks with the MindFormers TrainerCallback events.

They live in `mindmon.callbacks`, not in a top-level `callbacks` package, because many training
repositories have a `callbacks.py` of their own next to the launch script, which would shadow it.
"""
from mindmon.features.max_logits.callback import MaxLogitsMonitor
from mindmon.features.profiler.callback import ProfilerCallback
from mindmon.trainer_callbacks import MonitorCallback, TrainerCallback

__all__ = ["MaxLogitsMonitor", "MonitorCallback", "ProfilerCallback", "TrainerCallback"]
