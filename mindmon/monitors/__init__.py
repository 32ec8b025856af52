"""Collectors that receive `record(...)` calls from the trainer through MonitorGroup."""
from .train_state import GradientSnapshot, TrainStateMonitor

__all__ = ["GradientSnapshot", "TrainStateMonitor"]
