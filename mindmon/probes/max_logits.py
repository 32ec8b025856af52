"""A running max of the attention logits QK^T * scale per head, from an attention cell's inputs."""
import math
from typing import Dict, List, Optional

import numpy as np

from ._select import named_cells

LAYOUTS = ("BNSD", "BSND", "BSH", "TH")


def _heads_first(tensor, layout: str, num_heads: int):
    """(batch, heads, seq, head_dim) from one of LAYOUTS; TH is (tokens, heads * head_dim)."""
    if layout == "BNSD":
        return tensor
    if layout == "BSND":
        return tensor.transpose(0, 2, 1, 3)
    if layout == "TH":
        tensor = tensor.reshape((1,) + tuple(tensor.shape))
    batch, seq, hidden = tensor.shape
    return tensor.reshape(batch, seq, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)


class MaxLogitProbe:
    """One attention cell: the forward hook and its running max (a Tensor of shape (num_heads,))."""

    def __init__(self, name: str, model, num_heads: int, layout: str, mask_input: Optional[int],
                 causal: bool, scale: Optional[float]):
        self.name = f"{name}.max_logits_val"
        self.model, self.num_heads, self.layout = model, num_heads, layout
        self.mask_input, self.causal, self.scale = mask_input, causal, scale
        self.reset()

    def reset(self) -> None:
        from mindspore import Tensor

        self.value = Tensor(np.full(self.num_heads, -np.inf, np.float32))

    def __call__(self, cell, inputs, output) -> None:
        if not getattr(self.model, "track_max_attention_logit", True):
            return
        from mindspore import mint, ops

        q, k = (_heads_first(ops.stop_gradient(t), self.layout, self.num_heads).float() for t in inputs[:2])
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        scores = ops.matmul(q, k.swapaxes(-1, -2)) * scale             # (batch, heads, q_len, k_len)
        masked = self._masked(inputs, scores)
        if masked is not None:
            scores = mint.where(masked, float("-inf"), scores)
        head_max = scores.swapaxes(0, 1).reshape(self.num_heads, -1).max(axis=1)
        self.value = mint.maximum(self.value, head_max)

    def _masked(self, inputs, scores):
        """Where the attention does not look: the cell's own mask input (bool or 0/1: True = masked,
        MindFormers' convention; float: additive, masked where negative), or a causal triangle."""
        import mindspore as ms
        from mindspore import Tensor, ops

        if self.mask_input is not None:
            mask = ops.stop_gradient(inputs[self.mask_input])
            masked = mask < 0 if mask.is_floating_point() else mask.astype(ms.bool_)
            return masked.reshape(masked.shape if masked.ndim == 4 else (1, 1) + tuple(masked.shape[-2:]))
        if self.causal:
            q_len, k_len = scores.shape[-2:]
            return Tensor(np.triu(np.ones((q_len, k_len), bool), k=1 + k_len - q_len))
        return None


class MaxLogitProbes:
    """The probes attached to one model; installed on the model as `get_max_attention_logit()`,
    `reset_max_attention_logit()` and `track_max_attention_logit` (on at attach).

    Example:
        probes = attach_max_logit_probes(model, r"self_attn\\.core$", num_heads=8, layout="BNSD", causal=True)
        # ... train with `callbacks: [{type: MaxLogitsMonitor}]` as usual
        probes.detach()
    """

    def __init__(self, model, probes: List[MaxLogitProbe], handles: list):
        self.model, self.probes, self.handles = model, probes, handles

    def get_max_attention_logit(self) -> Dict[str, object]:
        return {probe.name: probe.value for probe in self.probes}

    def reset_max_attention_logit(self) -> None:
        for probe in self.probes:
            probe.reset()

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        for name in ("get_max_attention_logit", "reset_max_attention_logit", "track_max_attention_logit"):
            self.model.__dict__.pop(name, None)


def attach_max_logit_probes(model, cells: str, num_heads: int, layout: str = "BNSD",
                            mask_input: Optional[int] = None, causal: bool = False,
                            scale: Optional[float] = None) -> MaxLogitProbes:
    """Hook every cell whose name matches the regex `cells`; each takes the query and key as its first
    two inputs, in `layout` (BNSD, BSND, BSH or TH = flattened tokens x hidden). `mask_input` is the
    index of the cell's mask input, if it has one; else `causal` masks future keys. `scale` defaults
    to 1/sqrt(head_dim). The probe recomputes QK^T (one extra matmul per attention call)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: got {layout!r}; allowed: {list(LAYOUTS)}")
    if callable(getattr(model, "get_max_attention_logit", None)):
        raise ValueError(f"{type(model).__name__} already has get_max_attention_logit(); it tracks its "
                         f"own max attention logits, attach no probe")
    probes, handles = [], []
    for name, cell in named_cells(model, cells, "attach_max_logit_probes"):
        probe = MaxLogitProbe(name, model, num_heads, layout, mask_input, causal, scale)
        handles.append(cell.register_forward_hook(probe))
        probes.append(probe)
    attached = MaxLogitProbes(model, probes, handles)
    model.get_max_attention_logit = attached.get_max_attention_logit
    model.reset_max_attention_logit = attached.reset_max_attention_logit
    model.track_max_attention_logit = True
    return attached
