"""`print_struct` (what every cell gets and gives, for writing `targets` specs) and `stack_info` (where in the
code each cell is called), both from the first step's hooks.

print_struct writes `$MONITOR_OUTPUT_DIR/module_struct/rank<r>/module_struct.json`:

    {"fc1": {"input":       {"config": "tuple[1]", "0": "size=(4, 4), dtype=Float32"},
             "output":      {"config": "tensor",   "0": "size=(4, 8), dtype=Float32"},
             "input_grad":  {"config": "tuple[1]", "0": "None"},
             "output_grad": {"config": "tuple[1]", "0": "size=(4, 8), dtype=Float32"}}, ...}

one entry per cell in `cells_and_names()` order (the root cell's name is ""), each value as the first call
of the cell gave it. The `config` strings are the specs that match: `"output": "tensor"`,
`"input": "tuple[1]:0"`. Then training stops: `StopTraining` (a SystemExit with status 0) is raised at
the end of step 0, after the file is written and the monitor's files are closed.

stack_info writes `stack_info.csv` into the run folder, header `module_name,stack_info`: per cell, the
frames of the code that called it (outside MindSpore and mindmon), innermost first, one per line as
`<file>:<line> in <function>: <source>`; the first line is the call site. Only the first call of each cell
in the first collected step; the hooks are detached at that step's end.
"""
import csv
import json
import logging
import os
import traceback
from typing import Dict, List

logger = logging.getLogger("mindmon")

STRUCT_FOLDER = "module_struct"
STRUCT_FILE = "module_struct.json"
STACK_FILE = "stack_info.csv"


class StopTraining(SystemExit):
    """Raised where the monitor ends training on purpose (print_struct after step 0): exit status 0, no
    traceback when not caught; the message says why and where the output is."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


def describe_struct(value) -> Dict[str, str]:
    from mindmon.features.tensor_stats.activations import is_tensor

    if is_tensor(value):
        return {"config": "tensor", "0": _describe_item(value)}
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    described = {"config": f"tuple[{len(items)}]"}
    described.update({str(i): _describe_item(item) for i, item in enumerate(items)})
    return described


def _describe_item(item) -> str:
    from mindmon.features.tensor_stats.activations import is_tensor

    if is_tensor(item):
        return f"size={tuple(int(d) for d in item.shape)}, dtype={item.dtype}"
    return "None" if item is None else type(item).__name__


class StructHooks:
    """Forward and backward hooks on every cell, keeping what each cell's first call gets and gives."""

    def __init__(self):
        self.struct: Dict[str, Dict[str, dict]] = {}
        self.handles: List = []

    def attach(self, model) -> None:
        for name, cell in model.cells_and_names():
            self.struct[name] = {}
            self.handles.append(cell.register_forward_hook(self._forward(name)))
            self.handles.append(cell.register_backward_hook(self._backward(name)))

    def _forward(self, name: str):
        def hook(cell, inputs, output):
            entry = self.struct[name]
            if "input" not in entry:
                entry.update(input=describe_struct(inputs), output=describe_struct(output))
        return hook

    def _backward(self, name: str):
        def hook(cell, grad_input, grad_output):
            entry = self.struct[name]
            if "input_grad" not in entry:
                entry.update(input_grad=describe_struct(grad_input), output_grad=describe_struct(grad_output))
        return hook

    def write(self, root: str, rank: int) -> str:
        folder = os.path.join(root, STRUCT_FOLDER, f"rank{rank}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STRUCT_FILE)
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.struct, file, indent=2)
        return path

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _skipped_packages() -> tuple:
    import mindspore

    import mindmon

    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (mindspore, mindmon))


def caller_frames(limit: int = 8) -> List[str]:
    """The calling code's frames, innermost first, without MindSpore's and mindmon's own."""
    frames = []
    skipped = _skipped_packages()
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(skipped):
            continue
        frames.append(f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}")
        if len(frames) == limit:
            break
    return frames


class StackHooks:
    """A forward hook on every cell keeping where its first call came from (the caller's frames are still
    on the stack when it runs; a pre-hook would sit in the dict the root's step-counting pre-hook is
    iterated from, which detaching must not change)."""

    def __init__(self):
        self.stacks: Dict[str, List[str]] = {}
        self.handles: List = []

    def attach(self, model, collecting) -> None:
        for name, cell in model.cells_and_names():
            self.handles.append(cell.register_forward_hook(self._hook(name, collecting)))

    def _hook(self, name: str, collecting):
        def hook(cell, inputs, output):
            if name not in self.stacks and collecting():
                self.stacks[name] = caller_frames()
        return hook

    def write(self, folder: str) -> str:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STACK_FILE)
        with open(path, "w", newline="", encoding="utf-8") as file:
            writer = csv.writer(file)
            writer.writerow(["module_name", "stack_info"])
            writer.writerows([name, "\n".join(frames)] for name, frames in self.stacks.items())
        return path

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
