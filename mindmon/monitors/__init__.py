"""Monitors: each turns what the training loop hands it into records (mindmon.engine.Monitor)."""
from .max_attention_logit import MaxAttentionLogitMonitor
from .moe_tokens import MoETokensMonitor
from .train_state import GradientSnapshot, TrainStateMonitor

__all__ = ["GradientSnapshot", "MaxAttentionLogitMonitor", "MoETokensMonitor", "TrainStateMonitor"]
