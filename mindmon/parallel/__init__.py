"""Model parallelism: the layout of a rank (tensor, pipeline, expert, context and data parallel groups,
how each parameter is split) and the sums that make every number mean what it means on one device.
docs/model-parallel.md says what each metric is under each kind of parallelism.
"""
from .layout import Placement, ParallelLayout, megatron_layout, parallel_layout

__all__ = ["Placement", "ParallelLayout", "megatron_layout", "parallel_layout"]
