"""Statistics of the tensors MindSpore's collective calls carry (msprobe's `cc_distribution`).

While attached, the calls of `ops.AllReduce`, `ops.AllGather`, `ops.ReduceScatter`, `ops.Broadcast`
(their class's `__call__`, so every instance, wherever it was made) and of the `mindspore.communication.
comm_func` functions `all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`, `broadcast` (the module
attributes: code that imported a function by name before attaching keeps the original) go through a wrapper:

- the call site is the innermost frame outside MindSpore and mindmon, `file.py[line]`; with `cc_codeline`
  only calls whose stack has a line matching one of the regular expressions are taken;
- each distinct (function, stack) is logged once: the stack, the input dtypes and the communication group;
- `cc_pre_hook`: the inputs' statistics before the call (kind `cc_pre`); always the outputs' after it
  (kind `cc_post`); rows named `<function>.<file>[<line>].<n>.input|output` (`_i` with several tensors),
  n counting the calls of that function (at every site, as msprobe's call index): within the step, or,
  with the monitor's `calls_restart_each_step` off (msprobe's TrainerMon), since attaching, in every step
  collected or not (the calls `cc_codeline` leaves out not counted, as msprobe);
- `cc_log_only`: logging only, no statistics, and training is stopped (`CollectivesLogged`, exit status 0)
  before the second optimizer step.

`remove()` puts back exactly what was there (a class attribute deleted again, a module function restored).
Failures of the user's call propagate unchanged; failures of the monitoring are logged once.
"""
import logging
import os
import re
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mindmon.config import ConfigError
from mindmon.features.tensor_stats.monitor import TensorStatsMonitor
from mindmon.features.l2.config import CcConfig, warn_once

logger = logging.getLogger("mindmon")
CC_PRE = "cc_pre"      # inputs, before the call
CC_POST = "cc_post"    # outputs, after the call
PRIMITIVES = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast")
COMM_FUNCS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
_OWN_DIRS = None


class CollectivesLogged(SystemExit):
    """`cc_log_only`: the collective calls are logged and training ends here on purpose (exit status 0)."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class CollectiveStatsMonitor(TensorStatsMonitor):
    """The tensor statistics (config `ops`) of collective inputs and outputs; `next_call` numbers the calls
    of one function (wherever they are made: the number alone tells a call from the others of the
    function, as in msprobe's tag `AllReduce/rank0/post_3_0`), from 0 at each step while
    `calls_restart_each_step` (msprobe's monitor_v2, mindmon's own outputs), else from attaching on
    (msprobe's TrainerMon, whose MindSpore call index never starts again)."""

    KEYS = (CC_PRE, CC_POST)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: Dict[str, int] = {}
        self.calls_restart_each_step = True

    def reset(self) -> None:
        super().reset()
        if self.calls_restart_each_step:
            self.calls = {}

    def next_call(self, function: str) -> int:
        self.calls[function] = self.calls.get(function, 0) + 1
        return self.calls[function] - 1


def _own_dirs() -> Tuple[str, ...]:
    global _OWN_DIRS
    if _OWN_DIRS is None:
        import mindspore

        _OWN_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                          for m in (mindspore, sys.modules["mindmon"]))
    return _OWN_DIRS


def call_stack() -> List[str]:
    """`file.py[line]` of each frame outside MindSpore and mindmon, innermost first."""
    frame, lines, own = sys._getframe(1), [], _own_dirs()
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(own):
            lines.append(f"{path}[{frame.f_lineno}]")
        frame = frame.f_back
    return lines


def _tensors(value) -> list:
    from mindspore import Tensor

    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _named(prefix: str, role: str, tensors: Sequence) -> List[tuple]:
    if len(tensors) == 1:
        return [(f"{prefix}.{role}", tensors[0])]
    return [(f"{prefix}.{role}_{i}", t) for i, t in enumerate(tensors)]


class CollectivePatch:
    """Wraps the collective calls while attached; `remove()` restores them exactly. One at a time: a
    second patch over the first could not be undone in any order."""

    active: Optional["CollectivePatch"] = None

    def __init__(self, recorder, monitor: Optional[CollectiveStatsMonitor], cc: CcConfig,
                 collecting: Callable[[], bool]):
        if CollectivePatch.active is not None:
            raise ConfigError("cc_distribution.enable: got True while another TrainerMon already watches the "
                              "collectives; allowed: one at a time (close the other first)")
        # `recorder` (the group, or the monitor itself) takes the records; `monitor` numbers the calls.
        self.recorder, self.monitor, self.cc, self.collecting = recorder, monitor, cc, collecting
        self.patterns = [re.compile(p) for p in cc.codeline]
        self.logged = set()
        self._local = threading.local()
        self._saved: List[tuple] = []   # (owner, attribute, had its own, original)
        CollectivePatch.active = self
        try:
            self._wrap_all()
        except BaseException:
            self.remove()
            raise

    def _wrap_all(self) -> None:
        from mindspore import ops
        from mindspore.communication import comm_func

        for name in PRIMITIVES:
            self._wrap(getattr(ops, name), "__call__", name, method=True)
        for name in COMM_FUNCS:
            if hasattr(comm_func, name):
                self._wrap(comm_func, name, f"comm_func.{name}", method=False)

    def _wrap(self, owner, attribute: str, api: str, method: bool) -> None:
        original = getattr(owner, attribute)
        self._saved.append((owner, attribute, attribute in vars(owner), original))
        patch = self

        if method:
            def wrapper(primitive, *args, **kwargs):
                return patch.call(api, lambda: original(primitive, *args, **kwargs), args, kwargs, primitive)
        else:
            def wrapper(*args, **kwargs):
                return patch.call(api, lambda: original(*args, **kwargs), args, kwargs, None)
        wrapper.__wrapped__ = original
        setattr(owner, attribute, wrapper)

    def remove(self) -> None:
        for owner, attribute, had_own, original in reversed(self._saved):
            if had_own:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)
        self._saved.clear()
        if CollectivePatch.active is self:
            CollectivePatch.active = None

    def call(self, api: str, run, args, kwargs, primitive):
        """The user's collective call, observed. Only the outermost collective of a call is taken;
        `cc_log_only` logs in every step (it is about finding the calls, not about collected steps)."""
        if getattr(self._local, "inside", False):
            return run()
        if not (self.cc.log_only or self.collecting()):
            self._count_uncollected(api)
            return run()
        stack = call_stack()
        if not self._taken(stack):
            return run()
        self._local.inside = True
        try:
            prefix = self._observe_before(api, stack, args, kwargs, primitive)
            output = run()
            if prefix is not None:
                self._record(CC_POST, prefix, "output", output)
            return output
        finally:
            self._local.inside = False

    def _taken(self, stack: List[str]) -> bool:
        return not self.patterns or any(p.search(line) for p in self.patterns for line in stack)

    def _count_uncollected(self, api: str) -> None:
        """A call outside the collected steps still takes its call index when the index runs over steps."""
        monitor = self.monitor
        if monitor is not None and not monitor.calls_restart_each_step and not self.cc.log_only \
                and self._taken(call_stack() if self.patterns else []):
            monitor.next_call(api)

    def _observe_before(self, api, stack, args, kwargs, primitive) -> Optional[str]:
        """Logs a new (function, stack) once; records the inputs with cc_pre_hook. The row prefix, or None
        when nothing is to be recorded."""
        try:
            tensors = _tensors(list(args) + list(kwargs.values()))
            self._log_once(api, stack, tensors, kwargs.get("group", getattr(primitive, "group", None)))
            if self.cc.log_only or self.monitor is None:
                return None
            site = os.path.basename(stack[0]) if stack else "?"
            prefix = f"{api}.{site}.{self.monitor.next_call(api)}"
            if self.cc.pre_hook:
                self._record(CC_PRE, prefix, "input", tensors)
            return prefix
        except Exception as error:  # noqa: BLE001 - the user's collective must run regardless
            warn_once("cc", "mindmon: collective statistics skipped: %s: %s", type(error).__name__, error)
            return None

    def _record(self, kind: str, prefix: str, role: str, value) -> None:
        tensors = _tensors(value)
        if tensors:
            self.recorder.record(kind, _named(prefix, role, tensors))

    def _log_once(self, api: str, stack: List[str], tensors: Sequence, group) -> None:
        key = (api, tuple(stack))
        if key in self.logged:
            return
        self.logged.add(key)
        if group is None:
            from mindspore.communication import GlobalComm

            group = GlobalComm.WORLD_COMM_GROUP
        logger.warning("mindmon: collective %s, input dtype %s, group %s, called from:\n    %s", api,
                       ", ".join(str(t.dtype) for t in tensors) or "-", group, "\n    ".join(stack))


class StopAfterLogging:
    """cc_log_only: restores the collectives and ends training with CollectivesLogged once a step's calls
    are logged. With an optimizer, `before_step` runs before each optimizer step and stops at the second (as
    msprobe does); without one (kj600's hook_modules alone), `before_forward` runs before each forward of
    the model and stops at the first forward of the second step (forward grad_acc_steps + 1)."""

    def __init__(self, patch: CollectivePatch, grad_acc_steps: int = 1):
        self.patch, self.calls = patch, 0
        self.grad_acc_steps, self.forwards = grad_acc_steps, 0

    def before_step(self, *unused) -> None:
        self.calls += 1
        if self.calls >= 2:
            self._stop("before the second optimizer step")

    def before_forward(self, cell, inputs) -> None:
        if cell.training:   # as the step count without an optimizer: forwards in training mode
            self.forwards += 1
            if self.forwards > self.grad_acc_steps:
                self._stop("at the first forward of the second step")

    def _stop(self, when: str) -> None:
        self.patch.remove()
        message = (f"mindmon: cc_distribution.cc_log_only: {len(self.patch.logged)} distinct collective call(s) "
                   f"logged above; training stopped {when} as configured")
        logger.warning(message)
        raise CollectivesLogged(message)
