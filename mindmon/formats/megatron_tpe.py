"""Tokens per expert in Megatron-Core's file schema, `<output_dir>/tokens_per_expert/rank<r>.jsonl`,
so its tooling reads mindmon's runs: one line per (step, MoE layer), one inner list per written
micro-batch, `iter` = the training step (Megatron's iteration); MTP lines add `mtp_idx`.

    {"iter": 3, "block": "decoder", "layer": 1, "tpe": [[5, 3, 4, 4], [6, 2, 4, 4]]}

A record names its layer `decoder.layers.<L>` or `mtp.layers.<i>` (the MTP module's one transformer
layer is layer 0); `layer_fields` and `layer_name` convert between the two.
"""
import json
import os
from typing import Dict, List, Union

from mindmon.core.records import TOKENS_PER_EXPERT, Record


def tokens_per_expert_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, "tokens_per_expert", f"rank{rank}.jsonl")


def layer_fields(name: str) -> Dict[str, Union[str, int]]:
    """`decoder.layers.3` -> {block, layer}; `mtp.layers.0` -> {block, mtp_idx, layer: 0}."""
    block, _, index = name.split(".")
    if block == "mtp":
        return {"block": "mtp", "mtp_idx": int(index), "layer": 0}
    return {"block": block, "layer": int(index)}


def layer_name(fields: dict) -> str:
    if fields.get("block") == "mtp":
        return f"mtp.layers.{fields.get('mtp_idx', 0)}"
    return f"{fields.get('block', 'decoder')}.layers.{fields['layer']}"


def encode(step: int, name: str, micro_batches: List[List[int]]) -> str:
    return json.dumps({"iter": step, **layer_fields(name), "tpe": micro_batches})


def decode(data: dict, rank: int = 0) -> List[Record]:
    """The records of one parsed line; micro-steps are numbered 0.. in the line's order."""
    return [Record(int(data["iter"]), k, rank, TOKENS_PER_EXPERT, layer_name(data), list(tpe))
            for k, tpe in enumerate(data["tpe"])]
