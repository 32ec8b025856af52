"""The floating-point operations of each training step, read from the model's own forward (docs/flops.md).

Two counts, both as Python ints built from tensor shapes (host metadata: no device sync):

    executed  every matmul the hardware ran: each call of a matmul primitive held by a cell (nn.Dense,
              nn.Linear, ops.MatMul / BatchMatMul attributes) and of any matmul function passed through
              `FlopCounter.wrap`. 2*m*n*k per call, times 3 when the call builds a gradient (forward, then
              the data and weight gradients), times 1 when it does not. A recomputed cell runs its forward
              twice (once without gradient, once in the backward with it), and both runs are counted.
              This is what HFU divides.
    useful    the model's work on its tokens, for MFU: the same matmuls inside the model's forward, except
              that expert matmuls count only the tokens routed to (and kept by) each expert, and attention
              (the Q.K^T and A.V matmuls) counts each sequence at its real length; times 3 for a forward
              that builds a gradient. A recompute's second forward is no useful work.

What shapes cannot tell (which cell is the core attention and where its sequences begin, which cells are
experts and how many tokens each was routed) the caller declares with `AttentionSpec`, `ExpertSpec` and
the routed counts handed to `take_step`.
"""
import logging
import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

MATMUL_PRIMITIVES = ("MatMul", "BatchMatMul", "MatMulExt", "BatchMatMulExt", "Dense")
ATTENTION_LAYOUTS = ("TH", "BSH", "BSND", "BNSD")
# forward + gradient of the left operand + gradient of the right operand, each a matmul of the same size
TRAINING_PASSES = 3


def matmul_flops(a_shape: Sequence[int], b_shape: Sequence[int], transpose_a: bool = False,
                 transpose_b: bool = False) -> int:
    """2*m*n*k times the broadcast batch of a (batched) matmul of operands of these shapes; a 1-D operand
    is a vector (numpy's matmul rules)."""
    a, b = list(a_shape), list(b_shape)
    if len(a) == 1:
        a = [1] + a
    if len(b) == 1:
        b = b + [1]
    m, k = (a[-1], a[-2]) if transpose_a else (a[-2], a[-1])
    n = b[-2] if transpose_b else b[-1]
    batch = math.prod(_broadcast(a[:-2], b[:-2]))
    return 2 * batch * m * n * k


def _broadcast(a: List[int], b: List[int]) -> List[int]:
    width = max(len(a), len(b))
    a, b = [1] * (width - len(a)) + a, [1] * (width - len(b)) + b
    return [max(x, y) for x, y in zip(a, b)]


def primitive_flops(primitive, args: tuple) -> int:
    """The forward FLOPs of one call of a matmul primitive (a name in MATMUL_PRIMITIVES)."""
    name = type(primitive).__name__
    if name == "Dense":   # x (..., k) times w (n, k) transposed, as nn.Linear calls it
        return matmul_flops(args[0].shape, args[1].shape, transpose_b=True)
    attrs = getattr(primitive, "attrs", {})
    return matmul_flops(args[0].shape, args[1].shape, bool(attrs.get("transpose_a", False)),
                        bool(attrs.get("transpose_b", False)))


def _building_gradients() -> bool:
    """Whether PyNative records the running op for a backward (inside grad/value_and_grad and not under
    no_grad). MindSpore has no public query; the executor moved from common.api to graph.api in 2.9."""
    try:
        from mindspore.graph.api import _pynative_executor
    except ImportError:
        from mindspore.common.api import _pynative_executor
    return bool(_pynative_executor.requires_grad())


@dataclass(frozen=True)
class AttentionSpec:
    """The core-attention cells: `cells` is a regex over cell names matching the cells whose own matmuls
    are exactly Q.K^T and A.V (not the projections). The query is input `query_input`, in `layout`:
    TH (tokens, heads*head_dim), BSH (batch, seq, heads*head_dim), BSND or BNSD. `causal`: a query sees
    itself and the keys before it (s*(s+1)/2 pairs per sequence of s tokens), else all s*s pairs.
    `sequence_lengths(cell, inputs)` gives the lengths of the sequences of one call; required for TH
    (packed tokens), optional for the batched layouts (default: every row is a sequence of the full
    length, i.e. no padding)."""

    cells: str
    layout: str = "TH"
    causal: bool = True
    query_input: int = 0
    sequence_lengths: Optional[Callable[[object, tuple], Sequence[int]]] = None

    def __post_init__(self):
        if self.layout not in ATTENTION_LAYOUTS:
            raise ValueError(f"AttentionSpec.layout: got {self.layout!r}; allowed: {list(ATTENTION_LAYOUTS)}")
        if self.layout == "TH" and self.sequence_lengths is None:
            raise ValueError("AttentionSpec.sequence_lengths: got None with layout 'TH'; allowed: a function "
                             "(cell, inputs) -> the lengths of the packed sequences of one call")

    def useful_flops(self, cell, inputs: tuple) -> int:
        """Forward FLOPs of Q.K^T and A.V over the pairs each sequence attends to, with A.V's width taken
        as the query's (heads*head_dim: true for MHA and GQA, not for MLA's distinct value dim)."""
        shape = tuple(inputs[self.query_input].shape)
        width = {"TH": shape[-1], "BSH": shape[-1], "BSND": shape[-2] * shape[-1],
                 "BNSD": shape[1] * shape[-1]}[self.layout]
        if self.sequence_lengths is not None:
            lengths = [int(s) for s in self.sequence_lengths(cell, inputs)]
        else:
            seq = shape[2] if self.layout == "BNSD" else shape[1]
            lengths = [seq] * shape[0]
        pairs = sum(s * (s + 1) // 2 if self.causal else s * s for s in lengths)
        return 2 * 2 * pairs * width


@dataclass(frozen=True)
class ExpertSpec:
    """The expert cells: `cells` is a regex over cell names with a named group `layer` (the key of that
    MoE layer's routed counts in `take_step`, e.g. the name of the cell holding its `tokens_per_expert`)
    and a named group `expert` (the expert's index in those counts). Without an `expert` group each match
    is all the layer's experts at once (grouped experts), and its tokens are the sum of the counts."""

    cells: str

    def __post_init__(self):
        if "(?P<layer>" not in self.cells:
            raise ValueError(f"ExpertSpec.cells: got {self.cells!r}; allowed: a regex with a named group "
                             f"(?P<layer>...) naming the MoE layer of each expert")


@dataclass(frozen=True)
class StepFlops:
    """One step's FLOPs: `useful` (for MFU; None when the routed counts it needs are missing) and
    `executed` (for HFU)."""

    useful: Optional[int]
    executed: int


@dataclass
class _ExpertShape:
    """The last seen call of one expert: its forward FLOPs over the tokens (rows) it ran on."""

    flops: int = 0
    rows: int = 0


class _CellScope:
    """The attention or expert call currently running, so that a matmul knows where it is."""

    def __init__(self, kind: str, key=None):
        self.kind, self.key, self.flops = kind, key, 0


class FlopCounter:
    """Counts a model's FLOPs step by step, from its forward's shapes.

    Example:
        counter = FlopCounter(model, AttentionSpec(r"core_attention$", layout="BSH"),
                              ExpertSpec(r"^(?P<layer>.*\\.mlp)\\.experts\\.(?P<expert>\\d+)$"))
        loss, grads = grad_fn(batch)                       # any number of forwards and backwards
        step = counter.take_step(routed={"decoder.layers.1.mlp": [30, 2, 0, 32]})
        mfu(step.useful, seconds, peak)                     # and HFU: mfu(step.executed, ...)
        counter.detach()
    """

    def __init__(self, model, attention: Optional[AttentionSpec] = None, experts: Optional[ExpertSpec] = None,
                 logger: Optional[logging.Logger] = None):
        self.model, self.attention, self.experts = model, attention, experts
        self.logger = logger or logging.getLogger("mindmon")
        self._warned = set()
        self._wrapped: List[Tuple[object, str, object]] = []
        self._handles: list = []
        self._scopes: List[_CellScope] = []
        self._expert_shapes: Dict[tuple, _ExpertShape] = {}
        self._expert_keys: List[tuple] = []
        self._attention_cells = 0
        self._pass_multiplier = 0          # 0 outside the model's forward: no useful work is counted
        self._reset_step()
        self._attach()

    def _reset_step(self) -> None:
        self._executed = 0
        self._useful = 0
        self._trained = False

    def _attach(self) -> None:
        # bound methods: MindSpore 2.7 accepts only functions and methods as hooks
        self._handles.append(self.model.register_forward_pre_hook(self._pass_begins))
        self._handles.append(self.model.register_forward_hook(self._pass_ends))
        for name, cell in self.model.cells_and_names():
            self._wrap_primitives(cell)
            self._scope_cell(name, cell)
        if self.attention is not None and not self._attention_cells:
            raise ValueError(f"AttentionSpec.cells: the pattern {self.attention.cells!r} matches no cell of "
                             f"{type(self.model).__name__}")
        if self.experts is not None and not self._expert_keys:
            raise ValueError(f"ExpertSpec.cells: the pattern {self.experts.cells!r} matches no cell of "
                             f"{type(self.model).__name__}")

    def _wrap_primitives(self, cell) -> None:
        from mindspore.ops import Primitive

        for attr, value in list(vars(cell).items()):
            if isinstance(value, Primitive) and type(value).__name__ in MATMUL_PRIMITIVES:
                # object.__setattr__: Cell.__setattr__ would register the wrapper as a plain attribute
                object.__setattr__(cell, attr, self._counting(value, lambda args, p=value: primitive_flops(p, args)))
                self._wrapped.append((cell, attr, value))

    def wrap(self, matmul: Callable) -> Callable:
        """`matmul` (a function of two tensors, numpy's matmul rules: ops.matmul, mint.matmul, mint.bmm)
        counted like the primitives; put the result where the model looks the function up."""
        return self._counting(matmul, lambda args: matmul_flops(args[0].shape, args[1].shape))

    def _counting(self, call: Callable, flops_of: Callable[[tuple], int]) -> Callable:
        def counted(*args, **kwargs):
            self._count(flops_of(args))
            return call(*args, **kwargs)
        return counted

    def _count(self, forward: int) -> None:
        self._executed += forward * (TRAINING_PASSES if _building_gradients() else 1)
        if not self._pass_multiplier:
            return
        if self._scopes:
            self._scopes[-1].flops += forward   # attention and experts are counted by their own rule
        else:
            self._useful += forward * self._pass_multiplier

    def _scope_cell(self, name: str, cell) -> None:
        if self.attention is not None and re.search(self.attention.cells, name):
            self._hook_scope(cell, "attention", None)
            self._attention_cells += 1
        elif self.experts is not None:
            match = re.search(self.experts.cells, name)
            if match:
                expert = match.groupdict().get("expert")
                key = (match.group("layer"), None if expert is None else int(expert))
                self._expert_keys.append(key)
                self._hook_scope(cell, "expert", key)

    def _hook_scope(self, cell, kind: str, key) -> None:
        def begins(hooked, inputs):
            self._scopes.append(_CellScope(kind, key))

        def ends(hooked, inputs, output):
            scope = self._scopes.pop() if self._scopes else None
            if scope is not None and self._pass_multiplier:
                self._scope_done(scope, hooked, inputs)

        self._handles += [cell.register_forward_pre_hook(begins), cell.register_forward_hook(ends)]

    def _scope_done(self, scope: _CellScope, cell, inputs: tuple) -> None:
        if scope.kind == "attention":
            self._useful += self.attention.useful_flops(cell, inputs) * self._pass_multiplier
        else:
            self._expert_shapes[scope.key] = _ExpertShape(scope.flops, math.prod(inputs[0].shape[:-1]))

    def _pass_begins(self, cell, inputs) -> None:
        trained = _building_gradients()
        self._trained = self._trained or trained
        self._pass_multiplier = TRAINING_PASSES if trained else 1
        self._scopes.clear()

    def _pass_ends(self, cell, inputs, output) -> None:
        self._pass_multiplier = 0

    def take_step(self, routed: Optional[Mapping[str, Sequence[int]]] = None) -> StepFlops:
        """The FLOPs counted since the last call, and a fresh count. `routed`: this step's tokens per
        expert of each MoE layer ({layer: counts}, the layer as ExpertSpec's `layer` group names it;
        needed when experts are declared), kept tokens only when the router drops some."""
        useful = self._useful
        if self._expert_keys:
            experts = self._routed_flops(routed)
            useful = None if experts is None else useful + experts * (TRAINING_PASSES if self._trained else 1)
        step = StepFlops(useful, self._executed)
        self._reset_step()
        return step

    def _routed_flops(self, routed: Optional[Mapping[str, Sequence[int]]]) -> Optional[int]:
        total = 0
        for layer, expert in self._expert_keys:
            counts = None if routed is None else routed.get(layer)
            if counts is None:
                return self._missing(f"no routed counts for MoE layer {layer!r}: the tokens each expert was "
                                     f"given come from monitor.moe_monitor (switch it on), or take_step(routed=...) "
                                     f"in a loop of your own")
            tokens = int(sum(counts)) if expert is None else int(counts[expert])
            shape = self._expert_shapes.get((layer, expert))
            if tokens and (shape is None or not shape.rows):
                return self._missing(f"{layer} expert {expert}: tokens were routed to it but it never ran")
            if tokens:
                total += shape.flops * tokens // shape.rows
        return total

    def _missing(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self.logger.warning(f"mindmon: useful FLOPs: {what}; the step has no useful FLOPs and no MFU")
        return None

    def detach(self) -> None:
        """Removes the hooks and puts the model's own matmul primitives back."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for cell, attr, primitive in self._wrapped:
            object.__setattr__(cell, attr, primitive)
        self._wrapped = []


def mfu(flops: Optional[int], seconds: float, peak_flops_per_second: Optional[float]) -> Optional[float]:
    """flops / seconds / peak: the model FLOPs utilisation (with useful FLOPs) or the hardware one (with
    executed FLOPs); None when the FLOPs or the peak are unknown or no time passed."""
    if flops is None or peak_flops_per_second is None or not seconds or seconds <= 0:
        return None
    return flops / seconds / peak_flops_per_second
