"""Activation statistics (`xy_distribution`): each monitored cell's forward inputs and outputs (`actv`) and
their gradients (`actv_grad`), per micro-step, through Cell forward hooks and tensor hooks.

Which cells: `xy_distribution` on, then
  - a cell named in `targets` with specs collects what its specs name (`{}` = everything);
  - with `all_xy`, or with empty `targets`, every other cell collects everything;
  - `forward_only` drops the gradients, `backward_only` the forward tensors (both: nothing, a warning).
Only cells in training mode (`cell.training`) are collected.

Gradients: in a collected step's forward, a tensor hook goes on each output, and the cell gets a view of
each input in the input's place, with a tensor hook on the view: its gradient is what this cell sends back
to the input (the gradient a cell backward hook gets as grad_input). The hooks that set these are attached
only while steps are collected. Why not `Cell.register_backward_hook`: MindSpore's cell backward hooks slow
every step by about a tenth even when they return at once; forward hooks cost nothing measurable and the
tensor hooks about a third of that (docs/performance.md).

Specs (`targets: {"layers.0": {"input": "tuple[2]:0", "output": "tensor", ...}}`), per key
`input`, `output`, `input_grad`, `output_grad`:
    "tensor"       the value is one tensor (a hook's argument tuple holding exactly one tensor counts)
    "tuple[N]"     a tuple of N elements: every tensor in it
    "tuple[N]:i"   a tuple of N elements: element i (a tensor)
A cell whose value does not match its spec is reported once (an error naming the cell, the key, the spec
and what the cell got) and that hook is detached at the step end; the rest of the run goes on.

Row names: `<cell>.input` / `<cell>.output` (the root cell's name is empty: `.input`), `<cell>.input_<i>`
for element i of a value holding several; `actv_grad` uses the same names for the gradients of the same
tensors, so `.input_1` in both files is one tensor. A tensor that needs no gradient (data, masks, an input
that is not differentiated) has no `actv_grad` row.

Micro-steps: the root cell's forward pre-hook counts its calls in the step (0, 1, ... K-1); gradients get
the count of the forward they follow (forward and backward of a micro-batch run together, as in a
gradient-accumulation loop).
"""
import logging
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ..compat import named_cells, register_gradient_hook
from ..config import ConfigError, _describe
from ..monitors.tensor_stats import ACTV, ACTV_GRAD

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
        raise ConfigError(f"{path}: got {_describe(value)}; allowed: {_ALLOWED}")
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
        unknown = [key for key in entry if key not in SPEC_KEYS]
        if unknown:
            raise ConfigError(f"{path}.{name}.{unknown[0]}: unknown key; allowed keys: {list(SPEC_KEYS)}")
        specs[name] = {key: parse_spec(f"{path}.{name}.{key}", text) for key, text in entry.items()}
    return specs


def warn_forward_and_backward_only(path: str, flags: Dict[str, bool]) -> None:
    if flags.get("xy_distribution") and flags.get("forward_only") and flags.get("backward_only"):
        prefix = f"{path}." if path else ""
        logger.warning("mindmon: %sforward_only and %sbackward_only are both true: no activations are collected",
                       prefix, prefix)


def is_tensor(value) -> bool:
    from mindspore import Tensor

    return isinstance(value, Tensor)


def describe_value(value) -> str:
    """What a hook got, in spec words: `tensor`, `tuple[2] (Tensor, NoneType)`."""
    if is_tensor(value):
        return "tensor"
    if isinstance(value, (tuple, list)):
        return f"tuple[{len(value)}] ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def select(spec: Optional[Spec], value) -> List[Tuple[Optional[int], Optional[int], object]]:
    """(position or None, index in the tuple or None, element) of what the spec picks; position (the row
    name's suffix) is given when the value holds several; index is None for a bare tensor."""
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


def _named_items(cell: str, key: str, spec: Optional[Spec], value) -> List[Tuple[str, Optional[int], object]]:
    """(row name, index in the tuple or None, tensor) of the rows one key of one cell gives: tensors only
    (None gradients and non-tensor arguments have none)."""
    base = f"{cell}.{_ROW_NAME[key]}"
    return [(base if position is None else f"{base}_{position}", index, item)
            for position, index, item in select(spec, value) if is_tensor(item)]


def cell_plan(name: str, config) -> Dict[str, Optional[Spec]]:
    """{key: spec} this cell collects ({} = not monitored)."""
    if name in config.xy_specs:
        plan = dict(config.xy_specs[name])
    elif config.all_xy or not config.targets or name in config.targets:
        plan = dict.fromkeys(SPEC_KEYS)
    else:
        plan = {}
    dropped = FORWARD_KEYS if config.backward_only else BACKWARD_KEYS if config.forward_only else ()
    return {key: spec for key, spec in plan.items() if key not in dropped}


def check_spec_targets(model, config) -> None:
    """Every target with specs names a cell of the model (checked before training)."""
    cells = {name for name, _ in named_cells(model)}
    for name in config.xy_specs:
        if name not in cells:
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
    """Forward hooks and gradient (tensor) hooks on the monitored cells; `record(point, named_tensors, micro_step)`
    gets the tensors. `collecting()` says whether this step is collected (no work otherwise)."""

    def __init__(self, config, record: Callable, collecting: Callable[[], bool], micro_steps: MicroSteps,
                 guard: Callable):
        self.config = config
        self.record = record
        self.collecting = collecting
        self.micro_steps = micro_steps
        self.guard = guard
        self.handles: Dict[Tuple[str, str], object] = {}
        self._gradient_plans: List[Tuple[str, object, Dict[str, Optional[Spec]], bool]] = []
        self._root_input_hook: Optional[Callable] = None
        self._mismatched: List[Tuple[str, str]] = []
        # Hook calls of a collected step from cells in training mode / in eval mode: a step with only the
        # latter is a model never put in training mode (MindSpore cells start in eval mode), said once.
        self._training_calls = self._eval_calls = 0
        self._warned_eval = False

    def attach(self, model) -> int:
        """Hooks every monitored cell (gradient hooks if this step is collected); returns how many."""
        count = 0
        for name, cell in named_cells(model):
            plan = cell_plan(name, self.config)
            forward = {k: s for k, s in plan.items() if k in FORWARD_KEYS}
            backward = {k: s for k, s in plan.items() if k in BACKWARD_KEYS}
            if forward:
                self.handles[(name, "forward")] = cell.register_forward_hook(self._forward_hook(name, forward))
            if backward:
                self._gradient_plans.append((name, cell, backward, cell is model))
            count += bool(plan)
        self.follow_collection()
        return count

    def follow_collection(self) -> None:
        """Gradient hooks on for a collected step, off for one that is not (called between steps)."""
        collecting = self.collecting()
        for name, cell, plan, root in self._gradient_plans:
            key = (name, "backward")
            if collecting and key not in self.handles and key not in self._mismatched:
                self.handles[key] = self._attach_gradient_hooks(name, cell, plan, root)
            elif not collecting and key in self.handles:
                self.handles.pop(key).remove()

    def _attach_gradient_hooks(self, name: str, cell, plan: Dict[str, Optional[Spec]], root: bool) -> "HookGroup":
        """Gradients come from tensor hooks set in each forward: on the outputs, and on a view of each input
        that the cell gets in the input's place. The view has this cell as its only user, so its gradient is
        this cell's share of the input's gradient (a hook on the input itself would get the sum over all its
        users). MindSpore's cell backward hooks give the same two values, but slowed every step by about a
        tenth; these cost about a third of that (docs/performance.md). The root's inputs go through the
        micro-step counter's pre-hook (`root_inputs`): a step can end inside that hook, and adding or removing
        one of the root's pre-hooks then would change the dict MindSpore is iterating."""
        handles = []
        if "input_grad" in plan and root:
            self._root_input_hook = self._input_gradient_hook(name, plan["input_grad"])
            handles.append(_RootInputs(self))
        elif "input_grad" in plan:
            handles.append(cell.register_forward_pre_hook(self._input_gradient_hook(name, plan["input_grad"])))
        if "output_grad" in plan:
            handles.append(cell.register_forward_hook(self._output_gradient_hook(name, plan["output_grad"])))
        return HookGroup(handles)

    def root_inputs(self, cell, inputs) -> Optional[tuple]:
        """The root cell's inputs, put in place by the micro-step counter (see `_attach_gradient_hooks`)."""
        return self._root_input_hook(cell, inputs) if self._root_input_hook is not None else None

    def _forward_hook(self, name: str, plan: Dict[str, Optional[Spec]]):
        def hook(cell, inputs, output):
            if self.collecting() and self._counts_as_training(cell):
                self.guard(self._collect, name, plan, {"input": inputs, "output": output})
        return hook

    def _input_gradient_hook(self, name: str, spec: Optional[Spec]):
        def hook(cell, inputs):
            if not (self.collecting() and self._counts_as_training(cell)):
                return None
            replaced = list(inputs)
            self.guard(self._watch_inputs, name, spec, replaced)
            return tuple(replaced)
        return hook

    def _output_gradient_hook(self, name: str, spec: Optional[Spec]):
        def hook(cell, inputs, output):
            if self.collecting() and self._counts_as_training(cell):
                self.guard(self._watch_outputs, name, spec, output)
        return hook

    def _counts_as_training(self, cell) -> bool:
        if cell.training:
            self._training_calls += 1
            return True
        self._eval_calls += 1
        return False

    def _collect(self, name: str, plan, values) -> None:
        rows = []
        for key, spec in plan.items():
            items = self._checked(name, key, spec, values[key])
            if (name, "forward") in self._mismatched:
                return
            rows += [(row, tensor) for row, _, tensor in items]
        self.record(ACTV, rows, self.micro_steps.current)

    def _watch_inputs(self, name: str, spec: Optional[Spec], inputs: list) -> None:
        """Puts a view in place of each input the spec picks, its gradient hooked."""
        for row, index, tensor in self._checked(name, "input_grad", spec, tuple(inputs)):
            view = tensor.view(tensor.shape)
            if self._watch(view, row):
                inputs[index] = view

    def _watch_outputs(self, name: str, spec: Optional[Spec], output) -> None:
        # A tuple, as a cell backward hook's grad_output is (the specs users wrote are of that form)
        outputs = tuple(output) if isinstance(output, (tuple, list)) else (output,)
        for row, _, tensor in self._checked(name, "output_grad", spec, outputs):
            self._watch(tensor, row)

    def _watch(self, tensor, row: str) -> bool:
        """The tensor's gradient, when MindSpore computes it, becomes an actv_grad row; False for a tensor
        that needs no gradient (data, masks): no row, as for a None gradient."""
        try:
            register_gradient_hook(tensor, self._gradient_hook(row))
        except RuntimeError:   # "The tensor requires grad is false"
            return False
        return True

    def _gradient_hook(self, row: str):
        def hook(gradient):
            if self.collecting():   # the micro-step then running is the one whose forward set the hook
                self.guard(self.record, ACTV_GRAD, [(row, gradient)], self.micro_steps.current)
        return hook

    def _checked(self, name: str, key: str, spec: Optional[Spec], value) -> list:
        """`_named_items`, or [] once the value has not fitted its spec (said once; that direction of the
        cell is then left out for the rest of the run)."""
        direction = "forward" if key in FORWARD_KEYS else "backward"
        if (name, direction) in self._mismatched:
            return []
        try:
            return _named_items(name, key, spec, value)
        except SpecMismatch:
            self._mismatched.append((name, direction))
            logger.error("mindmon: targets.%s.%s is %r, but the cell %r got %s; its %s activations are not "
                         "collected (fix the spec; print_struct shows what each cell gets)", name, key, spec.text,
                         name, describe_value(value), direction)
            return []

    def end_step(self) -> None:
        """Says once if a collected step saw only cells in eval mode; detaches hooks whose spec did not match
        (not from inside a hook: MindSpore is iterating them)."""
        if self._eval_calls and not self._training_calls and not self._warned_eval:
            self._warned_eval = True
            logger.warning("mindmon: xy_distribution: every monitored cell ran in eval mode in this step "
                           "(Cell.training is False; MindSpore cells start so), so no activations were collected; "
                           "call model.set_train(True) before training")
        self._training_calls = self._eval_calls = 0
        for key in self._mismatched:
            handle = self.handles.pop(key, None)
            if handle is not None:
                handle.remove()

    def detach(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()


class HookGroup:
    """Several MindSpore hook handles, removed together."""

    def __init__(self, handles: List):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _RootInputs:
    """The handle of the root's input gradients (`ActivationHooks.root_inputs`)."""

    def __init__(self, hooks: ActivationHooks):
        self.hooks = hooks

    def remove(self) -> None:
        self.hooks._root_input_hook = None


def root_forward_counter(model, micro_steps: MicroSteps, on_new_forward: Optional[Callable] = None,
                         inputs_in_place: Optional[Callable] = None):
    """The root cell's forward pre-hook that counts micro-steps (only forwards in training mode);
    `inputs_in_place(cell, inputs)` may then give the inputs the root gets (None: unchanged)."""
    def hook(cell, inputs):
        if cell.training:
            if on_new_forward is not None:
                on_new_forward()
            micro_steps.begin_forward()
            if inputs_in_place is not None:
                return inputs_in_place(cell, inputs)
        return None
    return model.register_forward_pre_hook(hook)


