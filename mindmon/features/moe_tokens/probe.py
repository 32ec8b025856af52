"""A cumulative `tokens_per_expert` count on a router cell, from its output scores by a forward hook."""
from typing import List, Optional

import numpy as np

from mindmon.cells import named_cells


class TokensPerExpertProbe:
    """One router: adds the per-expert count of each token's top-k scores to `cell.tokens_per_expert`."""

    def __init__(self, cell, num_experts: int, topk: int, output_index: Optional[int]):
        self.cell, self.num_experts, self.topk, self.output_index = cell, num_experts, topk, output_index
        self.reset()

    def reset(self) -> None:
        from mindspore import Tensor

        self.cell.tokens_per_expert = Tensor(np.zeros(self.num_experts, np.float32))

    def __call__(self, cell, inputs, output) -> None:
        import mindspore as ms
        from mindspore import Tensor, ops

        scores = output if self.output_index is None else output[self.output_index]
        _, chosen = ops.topk(ops.stop_gradient(scores).reshape(-1, self.num_experts), self.topk)
        on, off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
        counts = ops.one_hot(chosen.reshape(-1), self.num_experts, on, off).sum(axis=0)
        cell.tokens_per_expert = cell.tokens_per_expert + counts


class TokensPerExpertProbes:
    """The counters attached to one model.

    Example:
        probes = attach_tokens_per_expert_probes(model, r"mlp\\.gate$", num_experts=64, topk=6)
        # ... train with `monitor.moe_monitor.save_tokens_per_expert_interval: 1`
        probes.detach()
    """

    def __init__(self, probes: List[TokensPerExpertProbe], handles: list):
        self.probes, self.handles = probes, handles

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        for probe in self.probes:
            probe.cell.__dict__.pop("tokens_per_expert", None)


def attach_tokens_per_expert_probes(model, routers: str, num_experts: int, topk: int,
                                    output_index: Optional[int] = None) -> TokensPerExpertProbes:
    """Hook every cell whose name matches the regex `routers`; its output (or `output[output_index]`)
    holds one score per expert for each token, and each token counts for its `topk` best experts.
    Name routers under `decoder.layers.<L>` / `mtp.layers.<i>` so the MoE monitor can tell the layers
    apart (MindFormers' naming)."""
    if not 0 < topk <= num_experts:
        raise ValueError(f"topk: got {topk!r}; allowed: 1..num_experts ({num_experts})")
    probes, handles = [], []
    for _, cell in named_cells(model, routers, "attach_tokens_per_expert_probes"):
        if getattr(cell, "tokens_per_expert", None) is not None:
            raise ValueError(f"{type(cell).__name__} already counts tokens_per_expert; attach no probe to it")
        probe = TokensPerExpertProbe(cell, num_experts, topk, output_index)
        # a bound method: MindSpore 2.7 accepts only functions and methods as hooks
        handles.append(cell.register_forward_hook(probe.__call__))
        probes.append(probe)
    return TokensPerExpertProbes(probes, handles)
