"""Where records go: log lines in the documented formats, and a lossless per-rank JSONL file."""
from .jsonl import JsonlSink
from .log import LogSink
from .megatron_tpe import MegatronTokensPerExpertSink

__all__ = ["JsonlSink", "LogSink", "MegatronTokensPerExpertSink"]
