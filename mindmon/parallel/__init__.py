"""Model parallelism: the layout of a rank (tensor, pipeline, expert, context and data parallel groups,
how each parameter is split) and the sums that make every number mean what it means on one device.
docs/model-parallel.md says what each metric is under each kind of parallelism.
`watchdog` is the peer watchdog of any run of several ranks: it names the ranks lost mid-run
(docs/multi-rank.md, "A lost node").
"""
from .layout import Placement, ParallelLayout, megatron_layout, parallel_layout

__all__ = ["Placement", "ParallelLayout", "megatron_layout", "parallel_layout"]
