"""Collectors that receive `record(...)` calls from the trainer through MonitorGroup."""
from .moe_tokens import MoETokensMonitor
from .train_state import GradientSnapshot, TrainStateMonitor

__all__ = ["GradientSnapshot", "MoETokensMonitor", "TrainStateMonitor"]
