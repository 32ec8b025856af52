"""Tokens per expert in Megatron-Core's own file schema, so its tooling reads mindmon's runs."""
import json
import os
from collections import defaultdict
from typing import Iterable

from ..records import TOKENS_PER_EXPERT, Record, moe_layer_fields


def tokens_per_expert_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, "tokens_per_expert", f"rank{rank}.jsonl")


class MegatronTokensPerExpertSink:
    """`<output dir>/tokens_per_expert/rank<r>.jsonl`: one line per (step, MoE layer), one inner list
    per written micro-batch, `iter` = the training step (Megatron's iteration).

    Example:
        sink = MegatronTokensPerExpertSink("./output/monitor", rank=0)
        sink.write(records)   # {"iter": 3, "block": "decoder", "layer": 1, "tpe": [[5, 3, 4, 4], [6, 2, 4, 4]]}
    """

    def __init__(self, output_dir: str, rank: int, append: bool = False):
        self.path = tokens_per_expert_path(output_dir, rank)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, records: Iterable[Record]) -> None:
        per_layer = defaultdict(list)   # insertion order: steps, then layers in model order
        for record in records:
            if record.kind == TOKENS_PER_EXPERT:
                per_layer[(record.step, record.name)].append(record.value)
        for (step, name), micro_batches in per_layer.items():
            self._file.write(json.dumps({"iter": step, **moe_layer_fields(name), "tpe": micro_batches}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
