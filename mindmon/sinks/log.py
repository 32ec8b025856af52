"""Log lines in the formats of the MindFormers monitoring doc (seed 000, section 1.1), to the character.

Per micro-step k of step S, in order:
    { "step": S, "micro_step": k }                     group marker before the norm lines
    { "local_norm": <parameter name>: 0.000381 }
    { "micro_step": k, "local_loss": 0.123 }
    {"iter": 2, "step": 1, "micro_step": 2, "block": "decoder", "layer": 1, "tpe": [[2, 4, 6, 8]]}
                                                        tokens per expert (upstream's JSON line; MTP adds mtp_idx)
then for the step:
    { "step": S }                                       group marker before the device_norm lines
    { "device_norm": <parameter name>: 1.234567 }
    { "step": S, "device_loss": 0.123 }
"""
import json
import logging
from itertools import groupby
from typing import Iterable, List

from ..records import DEVICE_LOSS, DEVICE_NORM, LOCAL_LOSS, LOCAL_NORM, TOKENS_PER_EXPERT, Record, moe_layer_fields


def _number(value: float) -> str:
    """A loss as a short JSON number: 6 decimals at most, trailing zeros dropped (0.123, 2.5)."""
    return repr(round(float(value), 6))


class LogSink:
    """Writes the documented `{ ... }` lines through a logger (MindFormers' logger when it is there).

    Example:
        sink = LogSink(logging.getLogger("mindmon"))
        sink.write([Record(4, 2, 0, "local_loss", "loss", 0.123)])  # { "micro_step": 2, "local_loss": 0.123 }
    """

    def __init__(self, logger: logging.Logger = None):
        self.logger = logger or logging.getLogger("mindmon")

    def write(self, records: Iterable[Record]) -> None:
        """Kinds without a documented line (micro_norm, MoE summaries) are JSONL only; max_attention_logit
        lines are MaxLogitsMonitor's own."""
        for line in self.format(list(records)):
            self.logger.info(line)

    @staticmethod
    def format(records: List[Record]) -> List[str]:
        lines = []
        micro = [r for r in records if r.micro_step is not None]
        for micro_step, group in groupby(sorted(micro, key=lambda r: r.micro_step), key=lambda r: r.micro_step):
            group = list(group)
            norms = [r for r in group if r.kind == LOCAL_NORM]
            if norms:
                lines.append(f'{{ "step": {norms[0].step}, "micro_step": {micro_step} }}')
                lines.extend(f'{{ "local_norm": {r.name}: {r.value:.6f} }}' for r in norms)
            lines.extend(f'{{ "micro_step": {micro_step}, "local_loss": {_number(r.value)} }}'
                         for r in group if r.kind == LOCAL_LOSS)
            lines.extend(_tokens_per_expert_line(r) for r in group if r.kind == TOKENS_PER_EXPERT)
        device_norms = [r for r in records if r.kind == DEVICE_NORM]
        if device_norms:
            lines.append(f'{{ "step": {device_norms[0].step} }}')
            lines.extend(f'{{ "device_norm": {r.name}: {r.value:.6f} }}' for r in device_norms)
        lines.extend(f'{{ "step": {r.step}, "device_loss": {_number(r.value)} }}'
                     for r in records if r.kind == DEVICE_LOSS)
        return lines

    def close(self) -> None:
        pass


def _tokens_per_expert_line(record: Record) -> str:
    return json.dumps({"iter": record.iteration, "step": record.step, "micro_step": record.micro_step,
                       **moe_layer_fields(record.name), "tpe": [record.value]})
