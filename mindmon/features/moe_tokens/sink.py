"""MegatronTokensPerExpertSink: tokens per expert in Megatron-Core's file schema (mindmon.formats.megatron_tpe)."""
from collections import defaultdict
from typing import List, Sequence

from mindmon.formats import megatron_tpe
from mindmon.core.records import TOKENS_PER_EXPERT, Record
from mindmon.sinks.lines import LinesFileSink


class MegatronTokensPerExpertSink(LinesFileSink):
    """`<output_dir>/tokens_per_expert/rank<r>.jsonl`: one line per (step, MoE layer).

    Example:
        sink.write(records)   # {"iter": 3, "block": "decoder", "layer": 1, "tpe": [[5, 3, 4, 4], [6, 2, 4, 4]]}
    """

    def file_path(self, rank: int) -> str:
        return megatron_tpe.tokens_per_expert_path(self.output_dir, rank)

    def lines(self, records: Sequence[Record]) -> List[str]:
        per_layer = defaultdict(list)   # insertion order: steps, then layers in model order
        for record in records:
            if record.kind == TOKENS_PER_EXPERT:
                per_layer[(record.step, record.name)].append(record.value)
        return [megatron_tpe.encode(step, name, tpe) for (step, name), tpe in per_layer.items()]
