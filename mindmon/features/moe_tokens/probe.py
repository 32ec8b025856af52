"""A cumulative `tokens_per_expert` count on a router cell, by a forward hook: the experts the router
actually chose, for each kind of router (docs/semantics.md, "Tokens per expert").

    selection="topk"     the output (or output[output_index]) holds one score or logit per expert for each
                         token, and the router takes each token's `topk` largest: Mixtral, Qwen2-MoE, OLMoE
                         (a Linear gate; softmax is monotonic, so the top-k of its logits is the top-k of
                         its probabilities)
    selection="indices"  output[output_index] holds the expert ids the router chose, one row per token:
                         DeepSeek-V3's DeepseekV3TopkRouter (returns topk_indices, topk_weights), GPT-OSS
    selection="grouped"  DeepSeek-V3's rule over the output logits: sigmoid, plus the cell's
                         `e_score_correction_bias` (another attribute with `bias=`), experts cut into
                         `num_groups` groups ranked by the sum of their two best scores, the `topk_groups`
                         best groups kept, and each token's `topk` best experts among them
    selection="mask"     output[output_index] is the router's dispatch mask after its capacity limit, one
                         0/1 row of experts per token (Switch Transformers' router: `(expert_index,
                         router_probs, router_logits)`, `output_index=0`): the kept tokens are counted per
                         expert, and the dropped ones (topk per token, minus those kept) apart, in the
                         cell's cumulative `tokens_dropped`

A probe never breaks the forward: an output it cannot read is logged once, the probe detaches itself and
training goes on. Integer expert ids under a selection that reads scores ("topk", "grouped") are such an
output: their top-k is no choice of the router's, so the first forward names selection="indices" (a cell's
output dtype is known only once it has run, so attaching cannot tell). Every op is a MindSpore function, so
a mindnlp model's tensors (whose methods are PyTorch's) work too.
"""
import logging
from typing import List, Optional

import numpy as np

from mindmon.core.names import cells_matching
from mindmon.compat import with_device_of

SELECTIONS = ("topk", "indices", "grouped", "mask")
SCORE_SELECTIONS = ("topk", "grouped")   # the selections that read one score per expert


def is_integer(tensor) -> bool:
    """The tensor's dtype is an integer one (its metadata: no read of the device)."""
    from mindspore.common import dtype

    return tensor.dtype in dtype.int_type + dtype.uint_type


class TokensPerExpertProbe:
    """One router: adds the per-expert count of the experts chosen for each token to `cell.tokens_per_expert`."""

    def __init__(self, name: str, cell, num_experts: int, topk: int, output_index: Optional[int],
                 selection: str = "topk", groups: tuple = (1, 1), bias: str = "e_score_correction_bias",
                 logger: Optional[logging.Logger] = None):
        self.name, self.cell, self.num_experts, self.topk = name, cell, num_experts, topk
        self.output_index, self.selection, self.groups, self.bias = output_index, selection, groups, bias
        self.logger = logger or logging.getLogger("mindmon")
        self.handle = None
        self.reset()

    def reset(self) -> None:
        from mindspore import Tensor

        self.cell.tokens_per_expert = Tensor(np.zeros(self.num_experts, np.float32))
        if self.selection == "mask":
            self.cell.tokens_dropped = Tensor(np.zeros((), np.float32))

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def __call__(self, cell, inputs, output) -> None:
        try:
            counts = self._counts(output)
            if self.selection == "mask":
                cell.tokens_dropped = self._added(cell.tokens_dropped, self._dropped(output, counts))
            cell.tokens_per_expert = self._added(cell.tokens_per_expert, counts)
        except Exception as error:   # the user's forward goes on whatever the probe met
            self.logger.warning(f"mindmon: tokens-per-expert probe {self.name}: {type(error).__name__}: {error}; "
                                f"the probe is detached and training goes on")
            self.detach()

    @staticmethod
    def _added(total, value):
        from mindspore import ops

        return with_device_of((ops.add(ops.stop_gradient(total), value),), (total,))[0]

    def _value(self, output):
        from mindspore import ops

        return ops.stop_gradient(output if self.output_index is None else output[self.output_index])

    def _dropped(self, output, counts):
        """Every token had topk slots; those the dispatch mask does not hold were dropped."""
        import mindspore as ms
        from mindspore import Tensor, ops

        tokens = int(np.prod(self._value(output).shape)) // self.num_experts
        return ops.sub(Tensor(float(tokens * self.topk), ms.float32), ops.reduce_sum(counts))

    def _counts(self, output):
        import mindspore as ms
        from mindspore import Tensor, ops

        value = self._value(output)
        if isinstance(value, (tuple, list)):
            raise ValueError(f"the router returns {len(value)} outputs; pass output_index= the one to read")
        if self.selection in SCORE_SELECTIONS and is_integer(value):
            where = "" if self.output_index is None else f"[{self.output_index}]"
            raise ValueError(f"the router's output{where} holds integer expert ids ({value.dtype}), not a score "
                             f"per expert; pass selection=\"indices\"")
        if self.selection == "mask":
            if value.shape[-1] != self.num_experts:
                raise ValueError(f"a dispatch mask of shape {tuple(value.shape)}; expected (..., {self.num_experts})")
            return ops.reduce_sum(ops.reshape(ops.cast(value, ms.float32), (-1, self.num_experts)), 0)
        if self.selection == "indices":
            chosen = ops.reshape(ops.cast(value, ms.int32), (-1,))
        else:
            scores = ops.reshape(ops.cast(value, ms.float32), (-1, self.num_experts))
            if self.selection == "grouped":
                scores = self._group_limited(scores)
            chosen = ops.reshape(ops.topk(scores, self.topk)[1], (-1,))
        on, off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
        return ops.reduce_sum(ops.one_hot(chosen, self.num_experts, on, off), 0)

    def _group_limited(self, logits):
        """DeepSeek-V3's scores for choice: sigmoid + bias, zero outside each token's best groups."""
        import mindspore as ms
        from mindspore import ops

        num_groups, topk_groups = self.groups
        bias = ops.cast(ops.stop_gradient(getattr(self.cell, self.bias)), ms.float32)
        scores = ops.add(ops.sigmoid(logits), ops.reshape(bias, (1, -1)))
        grouped = ops.reshape(scores, (-1, num_groups, self.num_experts // num_groups))
        group_scores = ops.reduce_sum(ops.topk(grouped, 2)[0], -1)
        kept = ops.reduce_sum(ops.one_hot(ops.topk(group_scores, topk_groups)[1], num_groups,
                                          ops.ones((), ms.float32), ops.zeros((), ms.float32)), 1)
        mask = ops.reshape(ops.broadcast_to(ops.expand_dims(kept, -1), grouped.shape), scores.shape)
        return ops.select(mask > 0, scores, ops.zeros_like(scores))


class TokensPerExpertProbes:
    """The counters attached to one model.

    Example:
        probes = attach_tokens_per_expert_probes(model, r"mlp\\.gate$", num_experts=64, topk=6)
        # ... train with `monitor.moe_monitor.save_tokens_per_expert_interval: 1`
        probes.detach()
    """

    def __init__(self, probes: List[TokensPerExpertProbe]):
        self.probes = probes

    @property
    def handles(self) -> list:
        return [probe.handle for probe in self.probes if probe.handle is not None]

    def detach(self) -> None:
        for probe in self.probes:
            probe.detach()
            probe.cell.__dict__.pop("tokens_per_expert", None)
            probe.cell.__dict__.pop("tokens_dropped", None)


def _check(num_experts: int, topk: int, selection: str, groups: tuple) -> None:
    if not 0 < topk <= num_experts:
        raise ValueError(f"topk: got {topk!r}; allowed: 1..num_experts ({num_experts})")
    if selection not in SELECTIONS:
        raise ValueError(f"selection: got {selection!r}; allowed: one of {list(SELECTIONS)}")
    num_groups, topk_groups = groups
    if selection == "grouped" and (num_experts % num_groups or not 0 < topk_groups <= num_groups):
        raise ValueError(f"num_groups, topk_groups: got {num_groups!r}, {topk_groups!r}; allowed: num_groups "
                         f"dividing num_experts ({num_experts}) and 1 <= topk_groups <= num_groups")


def attach_tokens_per_expert_probes(model, routers: str, num_experts: int, topk: int,
                                    output_index: Optional[int] = None, selection: str = "topk",
                                    num_groups: int = 1, topk_groups: int = 1,
                                    bias: str = "e_score_correction_bias",
                                    logger: Optional[logging.Logger] = None) -> TokensPerExpertProbes:
    """Hook every cell (or mindnlp module) whose name matches the regex `routers`; `selection` says how its
    output holds the choice (module docstring). The MoE monitor names each layer from the router's name
    (`decoder.layers.<L>`, `model.layers.<L>`, `mtp.layers.<i>`, or `monitor.moe_monitor.layer_pattern`)."""
    _check(num_experts, topk, selection, (num_groups, topk_groups))
    probes = []
    for name, cell in cells_matching(model, routers, "attach_tokens_per_expert_probes"):
        if getattr(cell, "tokens_per_expert", None) is not None:
            raise ValueError(f"{type(cell).__name__} already counts tokens_per_expert; attach no probe to it")
        if selection == "grouped" and getattr(cell, bias, None) is None:
            raise ValueError(f"{name}: selection 'grouped' reads the cell's {bias!r}, which it does not have; "
                             f"allowed: bias= the name of its score-correction bias")
        probe = TokensPerExpertProbe(name, cell, num_experts, topk, output_index, selection,
                                     (num_groups, topk_groups), bias, logger)
        # a bound method: MindSpore 2.7 accepts only functions and methods as hooks
        probe.handle = cell.register_forward_hook(probe.__call__)
        probes.append(probe)
    return TokensPerExpertProbes(probes)
