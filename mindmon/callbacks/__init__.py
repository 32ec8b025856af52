"""Training callbacks with the MindFormers TrainerCallback events.

They live in `mindmon.callbacks`, not in a top-level `callbacks` package, because many training
repositories have a `callbacks.py` of their own next to the launch script, which would shadow it.
"""
from .base import TrainerCallback
from .max_logits import MaxLogitsMonitor
from .monitor_callback import MonitorCallback
from .profiler import ProfilerCallback

__all__ = ["MaxLogitsMonitor", "MonitorCallback", "ProfilerCallback", "TrainerCallback"]
