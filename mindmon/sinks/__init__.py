"""Where records go: log lines in the documented formats, and a lossless per-rank JSONL file."""
from mindmon.sinks.jsonl import JsonlSink
from mindmon.sinks.log import LogSink

__all__ = ["JsonlSink", "LogSink"]
