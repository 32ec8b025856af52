"""Activation statistics (`xy_distribution`): each monitored cell's forward inputs and outputs (`actv`) and
their gradients (`actv_grad`), per micro-step, through Cell forward hooks and pre-hooks, tensor gradient
hooks and `HookBackward` markers.

Which cells: `xy_distribution` on, then
  - a cell named in `targets` with specs collects what its specs name (`{}` = everything);
  - with `all_xy`, or with empty `targets`, every other cell collects everything;
  - `forward_only` drops the gradients, `backward_only` the forward tensors (both: nothing, a warning).
Only cells in training mode (`cell.training`) are collected. The gradients' hooks are registered on the
tensors of a collected forward (`ActivationHooks` says how), so a step that is not collected has none.

Specs (`targets: {"layers.0": {"input": "tuple[2]:0", "output": "tensor", ...}}`), per key
`input`, `output`, `input_grad`, `output_grad`:
    "tensor"       the value is one tensor (a hook's argument tuple holding exactly one tensor counts)
    "tuple[N]"     a tuple of N elements: every tensor in it
    "tuple[N]:i"   a tuple of N elements: element i (a tensor)
A cell whose value does not match its spec is reported once (an error naming the cell, the key, the spec
and what the cell got) and that hook is detached at the step end; the rest of the run goes on.

Row names: `<cell>.input` / `<cell>.output` (the root cell's name is empty: `.input`), `<cell>.input_<i>`
for element i of a value holding several; with `squash_name`, `<cell>` is shortened as parameter names are
(`model.layers.0.mlp` -> `layers.0.mlp`; the full name where two cells would share a short one), and
targets match either form; `actv_grad` uses the same names for the gradients of the same
tensors, so `.input_1` in both files is one tensor. A gradient MindSpore does not compute (an input that
is not differentiated) is None and has no row.

Micro-steps: the root cell's forward pre-hook counts its calls in the step (0, 1, ... K-1); a gradient has
the count of the forward whose tensor it is the gradient of.
"""
import logging
import re
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from mindmon.parallel.chunks import names_match
from mindmon.compat import (is_floating, mindspore_types, named_cells, register_gradient_hook,
                            requires_grad_is_told)
from mindmon.config import ConfigError, check_keys, describe
from mindmon.features.tensor_stats.points import ACTV, ACTV_GRAD
from mindmon.features.tensor_stats.targets import squash_name

logger = logging.getLogger("mindmon")

FORWARD_KEYS = ("input", "output")
BACKWARD_KEYS = ("input_grad", "output_grad")
SPEC_KEYS = FORWARD_KEYS + BACKWARD_KEYS
_ROW_NAME = {"input": "input", "output": "output", "input_grad": "input", "output_grad": "output"}
_SPEC = re.compile(r"^(?:(?P<tensor>tensor)|tuple\[(?P<length>\d+)\](?::(?P<index>\d+))?)$")
_ALLOWED = "'tensor', 'tuple[N]' or 'tuple[N]:i' with i < N"


@dataclass(frozen=True)
class Spec:
    """One parsed spec: `length` None = "tensor"; `index` None = every element."""

    text: str
    length: Optional[int] = None
    index: Optional[int] = None


class SpecMismatch(Exception):
    """A cell's value does not have the shape its spec says."""


def parse_spec(path: str, value) -> Spec:
    match = _SPEC.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"{path}: got {describe(value)}; allowed: {_ALLOWED}")
    if match.group("tensor"):
        return Spec(value)
    length = int(match.group("length"))
    index = None if match.group("index") is None else int(match.group("index"))
    if length < 1 or (index is not None and index >= length):
        raise ConfigError(f"{path}: got {value!r}; allowed: {_ALLOWED}")
    return Spec(value, length, index)


def parse_xy_specs(path: str, targets) -> Dict[str, Dict[str, Optional[Spec]]]:
    """The targets that carry specs: {cell: {key: Spec}}; a target `{}` maps to every key (None = all)."""
    specs = {}
    for name, entry in (targets or {}).items():
        if not isinstance(entry, dict) or not entry:
            continue
        check_keys(f"{path}.{name}", entry, SPEC_KEYS)
        specs[name] = {key: parse_spec(f"{path}.{name}.{key}", text) for key, text in entry.items()}
    return specs


def warn_forward_and_backward_only(path: str, flags: Dict[str, bool]) -> None:
    if flags.get("xy_distribution") and flags.get("forward_only") and flags.get("backward_only"):
        prefix = f"{path}." if path else ""
        logger.warning("mindmon: %sforward_only and %sbackward_only are both true: no activations are collected",
                       prefix, prefix)


def is_tensor(value) -> bool:
    return isinstance(value, mindspore_types().tensor)


def describe_value(value) -> str:
    """What a hook got, in spec words: `tensor`, `tuple[2] (Tensor, NoneType)`."""
    if is_tensor(value):
        return "tensor"
    if isinstance(value, (tuple, list)):
        return f"tuple[{len(value)}] ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def select(spec: Optional[Spec], value) -> List[Tuple[Optional[int], Optional[int], object]]:
    """(label, place, element) of what the spec picks: label is the element's position where the value holds
    several (its row name's suffix), place its index in the value (None: the value is the element)."""
    items = list(value) if isinstance(value, (tuple, list)) else None
    if spec is None:
        if items is None:
            return [(None, None, value)]
        return [(None, 0, items[0])] if len(items) == 1 else [(i, i, item) for i, item in enumerate(items)]
    if spec.length is None:
        if items is None and is_tensor(value):
            return [(None, None, value)]
        if items is not None and len(items) == 1 and is_tensor(items[0]):
            return [(None, 0, items[0])]
        raise SpecMismatch()
    if items is None or len(items) != spec.length:
        raise SpecMismatch()
    if spec.index is None:
        return [(None, 0, items[0])] if spec.length == 1 else [(i, i, item) for i, item in enumerate(items)]
    chosen = items[spec.index]
    if chosen is not None and not is_tensor(chosen):
        raise SpecMismatch()
    return [(None, spec.index, chosen)]


class CellValues:
    """The rows one hook of one cell gives, for the keys of its plan: tensors only (None gradients and
    non-tensor arguments have none). Each key's place among the hook's arguments and its rows' base name
    (`<cell>.input`) are found once per cell, not at every call."""

    def __init__(self, cell: str, plan: Dict[str, Optional[Spec]], keys: Tuple[str, str]):
        self.entries = [(keys.index(key), key, spec, f"{cell}.{_ROW_NAME[key]}") for key, spec in plan.items()]

    def pick(self, arguments: tuple) -> List[Tuple[str, object]]:
        """(row name, tensor) pairs; SpecMismatch(key, spec, value) for a value its spec does not fit."""
        return [(row, tensor) for row, _, tensor in self.picked(arguments)]

    def picked(self, arguments: tuple) -> List[Tuple[str, Optional[int], object]]:
        """(row name, place in its value, tensor) of each row (place: see `select`)."""
        tensor_type = mindspore_types().tensor
        rows = []
        for place, key, spec, base in self.entries:
            value = arguments[place]
            if spec is None:   # everything: most values are a tensor or a tuple of one, taken without a call
                single = value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value
                if isinstance(single, tensor_type):
                    rows.append((base, None if single is value else 0, single))
                    continue
            try:
                chosen = select(spec, value)
            except SpecMismatch:
                raise SpecMismatch(key, spec, value) from None
            rows += [(base if label is None else f"{base}_{label}", index, item)
                     for label, index, item in chosen if isinstance(item, tensor_type)]
        return rows


def _target(name: str, targets, squash: bool) -> Optional[str]:
    """The key of `targets` naming this cell: its name itself first, then one naming it in every chunk
    (`layers.0` for `1:layers.0`), then, with squash_name, its short name."""
    if name in targets:
        return name
    matching = [target for target in targets if names_match(name, target)]
    if matching:
        return matching[0]
    short = squash_name(name) if squash else None
    return short if short in targets else None


def cell_plan(name: str, config) -> Dict[str, Optional[Spec]]:
    """{key: spec} this cell collects ({} = not monitored)."""
    # the exact name first, so that a chunk's own spec ("1:layers.0") wins over one for every chunk
    spec_target = _target(name, config.xy_specs, config.squash_name)
    if spec_target is not None:
        plan = dict(config.xy_specs[spec_target])
    elif config.all_xy or not config.targets or _target(name, config.targets, config.squash_name) is not None:
        plan = dict.fromkeys(SPEC_KEYS)
    else:
        plan = {}
    dropped = FORWARD_KEYS if config.backward_only else BACKWARD_KEYS if config.forward_only else ()
    return {key: spec for key, spec in plan.items() if key not in dropped}


def check_spec_targets(model, config) -> None:
    """Every target with specs names a cell of the model (checked before training)."""
    cells = {name for name, _ in named_cells(model)}
    if config.squash_name:
        cells |= {squash_name(name) for name in cells}
    for name in config.xy_specs:
        if not any(names_match(cell, name) for cell in cells):
            examples = sorted(cells)[:6]
            raise ConfigError(f"targets.{name}: names no cell of the model, but carries activation specs; allowed: "
                              f"cell names from cells_and_names(), such as {examples}")


class MicroSteps:
    """Micro-step of the current forward: the root cell's forward calls in this step, from 0."""

    def __init__(self):
        self.forwards = 0

    @property
    def current(self) -> int:
        return max(self.forwards - 1, 0)

    def begin_forward(self) -> None:
        self.forwards += 1

    def end_step(self) -> None:
        self.forwards = 0


class ActivationHooks:
    """The hooks on the monitored cells; `record(point, named_tensors, micro_step)` gets the tensors.
    `collecting()` says whether this step is collected (no work otherwise).

    No cell backward hooks: MindSpore wraps every cell that has one in `CellBackwardHook` ops, which slowed
    the step by about a tenth even when they returned at once (docs/performance.md). The gradients come
    from tensor gradient hooks instead, registered in a collected forward:
      - `output_grad`: on the cell's output tensors, in its forward hook (a tensor's gradient is the sum over
        its consumers, which is the gradient of the cell's output);
      - `input_grad`: through `InputGradient` markers, put between each input and the cell in its forward
        pre-hook: a marker's gradient is this cell's share only (an input that also feeds a residual
        connection gets the rest through the original tensor), as a cell backward hook gives it.
    A gradient row carries the micro-step of the forward that registered its hook."""

    def __init__(self, config, record: Callable, collecting: Callable[[], bool], micro_steps: MicroSteps,
                 guard: Callable):
        self.config = config
        self.record = record
        self.collecting = collecting
        self.micro_steps = micro_steps
        self.guard = guard
        self.handles: Dict[Tuple[str, str], object] = {}   # the hooks attached now, by the key of their plan
        self._planned: List[Tuple[Tuple[str, str], Callable, Callable]] = []   # key, register, hook
        self._root, self._root_input_hook = None, None   # the model, and its `input_grad` hook (`root_inputs`)
        self._uses: Dict[Tuple[str, str], Tuple[Tuple[str, str], ...]] = {}   # handle key: the keys it serves
        self._mismatched: List[Tuple[str, str]] = []
        # Whether a collected step had hook calls from cells in training mode / in eval mode: a step with
        # only the latter is a model never put in training mode (MindSpore cells start in eval mode), said once.
        self._saw_training = self._saw_eval = False
        self._warned_eval = False
        # Output tensors given a gradient hook in this forward, by id (weakly: a hook must not keep a tensor
        # alive): a parent cell that returns its child's output gets a row on the child's hook.
        self._watched: Dict[int, Tuple[weakref.ref, "GradientRow"]] = {}
        self._watched_step: Optional[int] = None
        # (cell's key, input's place, micro-step): its `InputGradient`, made once, used at every collected step
        self._input_gradients: Dict[Tuple[Tuple[str, str], int, int], "InputGradient"] = {}
        self._requires_grad_told = requires_grad_is_told()   # asked before training, not in a hook

    def attach(self, model) -> int:
        """Plans the hooks of every monitored cell, attached while steps are collected (`follow`); returns
        how many cells (their names: `monitored`)."""
        self.monitored: List[str] = []
        self.row_names: Dict[str, str] = {}
        self._root = model
        for name, cell in named_cells(model):
            plan = cell_plan(name, self.config)
            if not plan:
                continue
            self.row_names[name] = self._row_name(name)
            self.monitored.append(name)
            forward = {k: s for k, s in plan.items() if k in FORWARD_KEYS}
            outputs = {k: s for k, s in plan.items() if k == "output_grad"}
            if "input_grad" in plan and cell is model:   # through the micro-step counter: `root_inputs`
                self._root_input_hook = self._input_hook(name, plan["input_grad"])
            elif "input_grad" in plan:
                self._plan((name, "input_grad"), ((name, "input_grad"),),
                           cell.register_forward_pre_hook, self._input_hook(name, plan["input_grad"]))
            if forward or outputs:
                uses = ((name, "forward"),) * bool(forward) + ((name, "output_grad"),) * bool(outputs)
                self._plan((name, "forward"), uses, cell.register_forward_hook,
                           self._forward_hook(name, forward, outputs))
        return len(self.monitored)

    def _plan(self, key: Tuple[str, str], uses: Tuple[Tuple[str, str], ...], register: Callable, hook) -> None:
        self._planned.append((key, register, hook))
        self._uses[key] = uses

    def follow(self, collecting: bool) -> None:
        """The cells' hooks on for a collected step, off for one that is not (called between steps, or in
        the root's pre-hook that ends a step: never a pre-hook of the root, see `root_inputs`). A step
        that is not collected then makes no hook call (1,280 calls returning at once cost 0.16-0.19% of
        the benchmark's step). Unlike a cell backward hook, a forward hook or pre-hook adds no operation
        to MindSpore's step: `Cell` only looks whether it has any. A hook every use of which had a spec
        that did not fit stays off."""
        if not collecting:
            self._remove_hooks()
        elif not self.handles:
            for key, register, hook in self._planned:
                if not all(use in self._mismatched for use in self._uses[key]):
                    self.handles[key] = register(hook)

    def _remove_hooks(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()

    def root_inputs(self, inputs: tuple) -> Optional[tuple]:
        """The root cell's inputs through the markers of its `input_grad` (see `_watched_inputs`), asked by the
        micro-step counter's pre-hook; None: as they are."""
        hook = self._root_input_hook
        return hook(self._root, inputs) if hook is not None and self._root is not None else None

    def _row_name(self, name: str) -> str:
        """The cell's name in its rows: shortened with squash_name, unless another cell has that short name."""
        short = squash_name(name) if self.config.squash_name else name
        return name if short in self.row_names.values() else short

    def _in_training(self, cell) -> bool:
        """For a collected step: whether this cell's values are collected (training mode)."""
        if cell.training:
            self._saw_training = True
        else:
            self._saw_eval = True
        return cell.training

    def _forward_hook(self, name: str, forward: Dict[str, Optional[Spec]], outputs: Dict[str, Optional[Spec]]):
        values_key, outputs_key = (name, "forward"), (name, "output_grad")
        values = CellValues(self.row_names[name], forward, FORWARD_KEYS) if forward else None
        output_values = CellValues(self.row_names[name], outputs, ("output_grad",)) if outputs else None

        def hook(cell, inputs, output):
            if self.collecting() and self._in_training(cell):
                if values is not None and values_key not in self._mismatched:
                    rows = self.guard(self._pick, values_key, values.pick, (inputs, output))
                    if rows:
                        self.guard(self.record, ACTV, rows, self.micro_steps.current)
                if output_values is not None and outputs_key not in self._mismatched:
                    self.guard(self._watch_gradients, outputs_key, output_values, output)
        return hook

    def _input_hook(self, name: str, spec: Optional[Spec]):
        key = (name, "input_grad")
        values = CellValues(self.row_names[name], {"input_grad": spec}, ("input_grad",))

        def hook(cell, inputs):
            if self.collecting() and key not in self._mismatched and self._in_training(cell):
                return self.guard(self._watched_inputs, key, values, inputs)
            return None
        return hook

    def _pick(self, key: Tuple[str, str], take: Callable, arguments: tuple):
        """`take(arguments)` (a `CellValues`' `pick` or `picked`); None (said once, the key not collected
        again) where its spec does not fit."""
        try:
            return take(arguments)
        except SpecMismatch as mismatch:
            self._mismatched.append(key)
            value_key, spec, value = mismatch.args
            name, direction = key[0], "forward" if key[1] == "forward" else "backward"
            logger.error("mindmon: targets.%s.%s is %r, but the cell %r got %s; its %s activations are not "
                         "collected (fix the spec; print_struct shows what each cell gets)", name, value_key,
                         spec.text, name, describe_value(value), direction)
            return None

    def _watch_gradients(self, key: Tuple[str, str], values: CellValues, output) -> None:
        """A gradient hook on each output tensor the spec picks (one that needs no gradient has none). The
        spec sees the outputs as a tuple, as MindSpore hands a cell backward hook their gradients."""
        micro_step = self.micro_steps.current
        if micro_step != self._watched_step:
            self._watched.clear()
            self._watched_step = micro_step
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for row, tensor in self._pick(key, values.pick, (outputs,)) or ():
            self._watch_output(row, tensor, micro_step)

    def _watch_output(self, row: str, tensor, micro_step: int) -> None:
        """One gradient hook per output tensor: a tensor that is another cell's output too (a parent returning
        its last child's output) adds its row to that hook. Its gradient is one tensor at one moment, read
        once; two hooks would read it twice."""
        known = self._watched.get(id(tensor))
        if known is not None and known[0]() is tensor:
            known[1].rows.append(row)
            return
        hook = GradientRow(self, [row], micro_step)
        if watch_gradient(tensor, hook.on_gradient):
            self._watched[id(tensor)] = (weakref.ref(tensor), hook)

    def _watched_inputs(self, key: Tuple[str, str], values: CellValues, inputs: tuple) -> Optional[tuple]:
        """The cell's inputs with each floating one the spec picks passed through its `InputGradient`'s
        marker; None (the inputs as they are) where the spec picks none. An input MindSpore says its
        autograd does not track (`requires_grad_is_told`: an attention mask, a rotary table) gets no marker:
        no gradient reaches it, and a marker costs an operation in the forward pass (68 a step of the
        benchmark's model, 40 us each)."""
        rows = self._pick(key, values.picked, (inputs,))
        if not rows:
            return None
        micro_step, replaced = self.micro_steps.current, list(inputs)
        core = mindspore_types().core
        for row, place, tensor in rows:
            if self._requires_grad_told and not getattr(tensor, "_requires_grad", True):
                continue
            if is_floating(tensor._dtype if isinstance(tensor, core) else tensor.dtype):
                marker = self._input_gradients.get((key, place, micro_step))
                if marker is None:
                    marker = self._input_gradients[(key, place, micro_step)] = InputGradient(self, row, micro_step)
                replaced[place] = marker.mark(tensor)
        return tuple(replaced)

    def record_gradient(self, rows: List[str], gradient, micro_step: int) -> None:
        if self.collecting():
            self.guard(self.record, ACTV_GRAD, [(row, gradient) for row in rows], micro_step)

    def end_step(self) -> None:
        """Says once if a collected step saw only cells in eval mode; detaches hooks every use of which had
        a spec that did not match (not from inside a hook: MindSpore is iterating them)."""
        if self._saw_eval and not self._saw_training and not self._warned_eval:
            self._warned_eval = True
            logger.warning("mindmon: xy_distribution: every monitored cell ran in eval mode in this step "
                           "(Cell.training is False; MindSpore cells start so), so no activations were collected; "
                           "call model.set_train(True) before training")
        self._saw_training = self._saw_eval = False
        self._watched.clear()
        self._watched_step = None
        for key in [k for k in self.handles if all(use in self._mismatched for use in self._uses[k])]:
            self.handles.pop(key).remove()

    def detach(self) -> None:
        self._remove_hooks()
        self._input_gradients.clear()
        self._planned.clear()
        self._uses.clear()
        self._root_input_hook = self._root = None


class GradientRow:
    """The gradient hook of one tensor of one forward: its rows (one per cell it is an output of) and
    micro-step. Its bound `on_gradient` is the hook (MindSpore 2.7 takes functions and methods only): two
    objects, where a closure is four (a function and three cells); a collected step makes them per
    tensor, each alive until its backward, and what outlives the young generation makes the cycle
    collector walk the whole heap sooner."""

    __slots__ = ("hooks", "rows", "micro_step")

    def __init__(self, hooks: "ActivationHooks", rows: List[str], micro_step: int):
        self.hooks, self.rows, self.micro_step = hooks, rows, micro_step

    def on_gradient(self, gradient) -> None:
        self.hooks.record_gradient(self.rows, gradient, self.micro_step)


class InputGradient:
    """The `input_grad` row of one input of one cell at one micro-step: `mark(tensor)` gives the cell the
    input through MindSpore's `HookBackward` (an identity op whose backward hands the gradient to a Python
    function), whose gradient is this cell's share. Made once per (cell, input, micro-step) and used at every
    collected step. Why not a gradient hook on a view of the input: a view's backward copies its gradient
    (measured on CPU, fed through 20 ops of 170K float32 elements: 194 us more per op, against 27 us for
    this one; docs/performance.md), and it needed an object per input per step."""

    __slots__ = ("hooks", "rows", "micro_step", "mark")

    def __init__(self, hooks: "ActivationHooks", row: str, micro_step: int):
        from mindspore import ops

        self.hooks, self.rows, self.micro_step = hooks, [row], micro_step
        self.mark = ops.HookBackward(self.on_gradients)

    def on_gradients(self, gradients) -> None:
        """The marker's backward: its one gradient, in a tuple."""
        self.hooks.record_gradient(self.rows, gradients[0], self.micro_step)


def watch_gradient(tensor, hook) -> bool:
    """`hook(gradient)` on this tensor of the forward pass; False for a tensor no gradient flows to (MindSpore
    refuses a hook on a tensor that does not require one)."""
    core = mindspore_types().core   # its own dtype attribute: no Python frame (a hook calls this per tensor)
    if not is_floating(tensor._dtype if isinstance(tensor, core) else tensor.dtype):
        return False
    try:
        register_gradient_hook(tensor, hook)
    except RuntimeError:
        return False
    return True


def root_forward_counter(model, micro_steps: MicroSteps, on_new_forward: Optional[Callable] = None,
                         inputs_for: Optional[Callable] = None):
    """The root cell's forward pre-hook that counts micro-steps (only forwards in training mode);
    `on_new_forward()` first (it may end the step before), then the inputs the model gets:
    `inputs_for(inputs)`, None for the inputs as they are."""
    def hook(cell, inputs):
        if cell.training:
            if on_new_forward is not None:
                on_new_forward()
            micro_steps.begin_forward()
        return inputs_for(inputs) if inputs_for is not None else None
    return model.register_forward_pre_hook(hook)


