"""A running max of the attention logits QK^T * scale per query head, from an attention cell's inputs
or an attention function's arguments. Grouped-query attention (fewer key/value heads than query
heads, as in Llama 3, Qwen2, DeepSeek) is handled without repeating K: the query heads of a group are
multiplied with their shared K head by one broadcast matmul."""
import logging
import math
from typing import Callable, Dict, List, Optional

import numpy as np

from mindmon.core.names import cells_matching

LAYOUTS = ("BNSD", "BSND", "BSH", "TH")


def _heads_first(tensor, layout: str, num_heads: int):
    """(batch, heads, seq, head_dim) from one of LAYOUTS; TH is (tokens, heads * head_dim). A tensor
    that does not fit is a ValueError naming its shape (the probe then detaches itself). Functional ops
    only: with mindnlp loaded, Tensor methods follow PyTorch (mindmon/compat.py)."""
    from mindspore import ops

    expected_rank = {"BNSD": 4, "BSND": 4, "BSH": 3, "TH": 2}[layout]
    if tensor.ndim != expected_rank or (layout in ("BNSD", "BSND") and
                                        tensor.shape[1 if layout == "BNSD" else 2] != num_heads):
        raise ValueError(f"got shape {tuple(tensor.shape)}, expected {layout} with {num_heads} heads")
    if layout == "BNSD":
        return tensor
    if layout == "BSND":
        return ops.transpose(tensor, (0, 2, 1, 3))
    if layout == "TH":
        tensor = ops.expand_dims(tensor, 0)
    batch, seq, hidden = tensor.shape
    return ops.transpose(ops.reshape(tensor, (batch, seq, num_heads, hidden // num_heads)), (0, 2, 1, 3))


class MaxLogitProbe:
    """One attention call site: its running max (a Tensor of shape (num_heads,)), updated from Q and K.

    An input that does not match the configuration is logged once and the probe detaches itself:
    a probe never raises inside the model's forward.
    """

    def __init__(self, name: str, model, num_heads: int, layout: str, mask_input: Optional[int],
                 causal: bool, scale: Optional[float], num_kv_heads: Optional[int] = None,
                 logger: Optional[logging.Logger] = None):
        if num_kv_heads is not None and (num_kv_heads <= 0 or num_heads % num_kv_heads):
            raise ValueError(f"num_kv_heads: got {num_kv_heads}; allowed: a divisor of num_heads ({num_heads})")
        self.name = f"{name}.max_logits_val"
        self.model, self.num_heads, self.layout = model, num_heads, layout
        self.num_kv_heads = num_kv_heads or num_heads
        self.mask_input, self.causal, self.scale = mask_input, causal, scale
        self.logger = logger or logging.getLogger("mindmon")
        self.handle = None
        self.reset()

    def attach(self, cell) -> None:
        # a bound method: MindSpore 2.7 accepts only functions and methods as hooks
        self.handle = cell.register_forward_hook(self.__call__)

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def reset(self) -> None:
        from mindspore import Tensor

        self.value = Tensor(np.full(self.num_heads, -np.inf, np.float32))

    def __call__(self, cell, inputs, output) -> None:
        self.observe(inputs[0], inputs[1], inputs)

    def observe(self, query, key, inputs=()) -> None:
        if not getattr(self.model, "track_max_attention_logit", True):
            return
        try:
            self._update(query, key, inputs)
        except Exception as error:
            self.logger.warning(f"mindmon: max-logit probe {self.name}: {error}; the probe is detached and "
                                f"this layer is no longer tracked (check num_heads, num_kv_heads, layout)")
            self.detach()
            self.model = None   # tracked nothing more, even when called through a wrapped function

    def _update(self, query, key, inputs) -> None:
        import mindspore as ms
        from mindspore import ops

        q = ops.cast(_heads_first(ops.stop_gradient(query), self.layout, self.num_heads), ms.float32)
        k = ops.cast(_heads_first(ops.stop_gradient(key), self.layout, self.num_kv_heads), ms.float32)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        batch, _, q_len, head_dim = q.shape
        group = self.num_heads // self.num_kv_heads
        grouped_q = ops.reshape(q, (batch, self.num_kv_heads, group, q_len, head_dim))
        keys_t = ops.expand_dims(ops.swapaxes(k, -1, -2), 2)
        scores = ops.mul(ops.matmul(grouped_q, keys_t), scale)   # (b, kv, group, q, k)
        scores = ops.reshape(scores, (batch, self.num_heads, q_len, -1))
        masked = self._masked(inputs, scores)
        if masked is not None:
            scores = ops.masked_fill(scores, masked, float("-inf"))
        head_max = ops.amax(ops.reshape(ops.swapaxes(scores, 0, 1), (self.num_heads, -1)), axis=1)
        self.value = ops.maximum(self.value, head_max)

    def _masked(self, inputs, scores):
        """Where the attention does not look: the call's own mask input (bool or 0/1: True = masked,
        MindFormers' convention; float: additive, masked where negative), or a causal triangle."""
        import mindspore as ms
        from mindspore import Tensor, ops

        if self.mask_input is not None:
            mask = ops.stop_gradient(inputs[self.mask_input])
            masked = ops.less(mask, 0) if mask.is_floating_point() else ops.cast(mask, ms.bool_)
            return ops.reshape(masked, masked.shape if masked.ndim == 4 else (1, 1) + tuple(masked.shape[-2:]))
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

    def __init__(self, model, probes: List[MaxLogitProbe]):
        self.model, self.probes = model, probes

    def get_max_attention_logit(self) -> Dict[str, object]:
        return {probe.name: probe.value for probe in self.probes}

    def reset_max_attention_logit(self) -> None:
        for probe in self.probes:
            probe.reset()

    def detach(self) -> None:
        for probe in self.probes:
            probe.detach()
        for name in ("get_max_attention_logit", "reset_max_attention_logit", "track_max_attention_logit"):
            self.model.__dict__.pop(name, None)


def _install(model, probes: List[MaxLogitProbe]) -> MaxLogitProbes:
    if callable(getattr(model, "get_max_attention_logit", None)):
        raise ValueError(f"{type(model).__name__} already has get_max_attention_logit(); it tracks its "
                         f"own max attention logits, attach no probe")
    attached = MaxLogitProbes(model, probes)
    model.get_max_attention_logit = attached.get_max_attention_logit
    model.reset_max_attention_logit = attached.reset_max_attention_logit
    model.track_max_attention_logit = True
    return attached


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: got {layout!r}; allowed: {list(LAYOUTS)}")


def attach_max_logit_probes(model, cells: str, num_heads: int, layout: str = "BNSD",
                            mask_input: Optional[int] = None, causal: bool = False,
                            scale: Optional[float] = None, num_kv_heads: Optional[int] = None) -> MaxLogitProbes:
    """Hook every cell whose name matches the regex `cells`; each takes the query and key as its first
    two inputs, in `layout` (BNSD, BSND, BSH or TH = flattened tokens x hidden). `num_kv_heads` is the
    number of key/value heads under grouped-query attention (default: num_heads). `mask_input` is the
    index of the cell's mask input, if it has one; else `causal` masks future keys. `scale` defaults
    to 1/sqrt(head_dim). The probe recomputes QK^T (one extra matmul per attention call)."""
    _check_layout(layout)
    probes = [MaxLogitProbe(name, model, num_heads, layout, mask_input, causal, scale, num_kv_heads)
              for name, _ in cells_matching(model, cells, "attach_max_logit_probes")]
    attached = _install(model, probes)
    for probe, (_, cell) in zip(probes, cells_matching(model, cells, "attach_max_logit_probes")):
        probe.attach(cell)
    return attached


def track_attention_function(model, attention: Callable, names: List[str], num_heads: int,
                             layout: str = "BNSD", query_arg: int = 0, key_arg: int = 1,
                             mask_arg: Optional[int] = None, causal: bool = False, scale: Optional[float] = None,
                             num_kv_heads: Optional[int] = None, layer_of: Optional[Callable] = None):
    """For attention that is a function, not a cell (HuggingFace-style code): returns (probes, wrapped),
    where `wrapped` calls `attention` unchanged after passing its query and key (positional arguments
    `query_arg`, `key_arg`) to the probe of the calling layer. `names` are the layers, in call order
    within one forward; `layer_of(args, kwargs)` may name the layer instead (e.g. from a module
    argument). Put `wrapped` where the model looks the function up.

    Example:
        probes, wrapped = track_attention_function(model, modeling.attention, names=["layers.0", "layers.1"],
                                                   num_heads=4, num_kv_heads=2, query_arg=1, key_arg=2,
                                                   causal=True)
        modeling.attention = wrapped
    """
    _check_layout(layout)
    probes = {name: MaxLogitProbe(name, model, num_heads, layout, mask_arg, causal, scale, num_kv_heads)
              for name in names}
    attached = _install(model, list(probes.values()))
    order = list(names)
    calls = {"count": 0}

    def wrapped(*args, **kwargs):
        name = layer_of(args, kwargs) if layer_of is not None else order[calls["count"] % len(order)]
        calls["count"] += 1
        probe = probes.get(name)
        if probe is not None and probe.model is not None:
            probe.observe(args[query_arg], args[key_arg], args)
        return attention(*args, **kwargs)

    return attached, wrapped
