"""Forward hooks that feed the L2 features monitor: an attention cell's Q and K (its first two inputs), a
linear cell's 2-D `weight` (or `wg`). Attached to the named cells of a model only, removed by `remove()`.

Example (every attention and linear cell of a model, into a monitor of its own):
    monitor, handles = attach_l2_features(model)
    ... train; records = monitor.collect(step) at each step end ...
    for handle in handles: handle.remove()
"""
import inspect
import logging
from typing import Callable, List, Optional, Sequence, Tuple

from mindmon.parallel.chunks import names_match
from mindmon.config import ConfigError
from mindmon.features.l2.monitor import ATTENTION_HOOK, LINEAR_HOOK, L2FeaturesMonitor
from mindmon.features.l2.config import L2Config, warn_once

logger = logging.getLogger("mindmon")
WEIGHT_ATTRIBUTES = ("weight", "wg")


def linear_weight(cell):
    """The cell's 2-D `weight` or `wg` Parameter, None when it has neither."""
    for attribute in WEIGHT_ATTRIBUTES:
        weight = getattr(cell, attribute, None)
        if weight is not None and hasattr(weight, "name") and len(getattr(weight, "shape", ())) == 2:
            return weight
    return None


def takes_query_and_key(cell) -> bool:
    """The cell's construct takes (q/query, k/key, ...) first: an attention core whose Q and K can be read."""
    try:
        names = list(inspect.signature(cell.construct).parameters)[:2]
    except (TypeError, ValueError):
        return False
    return len(names) == 2 and names[0].lower() in ("q", "query") and names[1].lower() in ("k", "key")


def find_cells(model, names: Sequence[str], key_path: str) -> List[Tuple[str, object]]:
    """(name, cell) of the cells each configured name names, with or without a model chunk's `<c>:` prefix
    (mindmon.parallel.chunks); one that names none is a ConfigError."""
    cells = dict(model.cells_and_names())
    found = []
    for name in names:
        named = [(cell_name, cell) for cell_name, cell in cells.items() if names_match(cell_name, name)]
        if not named:
            examples = [n for n in cells if n][:4]
            raise ConfigError(f"{key_path}: {name!r} is not a cell of the model; allowed: names from "
                              f"cells_and_names(), such as {examples}")
        found += named
    return found


def select_l2_cells(model, l2: L2Config):
    """(attention cells, linear cells) the config names; `linear_hook: []` = every cell with a 2-D weight/wg."""
    key_path = f"{l2.path}.l2_targets" if l2.path else "l2_targets"
    attention = find_cells(model, l2.attention_targets, f"{key_path}.attention_hook")
    if l2.linear_targets is None:
        return attention, []
    if not l2.linear_targets:
        return attention, [(n, c) for n, c in model.cells_and_names() if linear_weight(c) is not None]
    linear = find_cells(model, l2.linear_targets, f"{key_path}.linear_hook")
    for name, cell in linear:
        if linear_weight(cell) is None:
            raise ConfigError(f"{key_path}.linear_hook: {name!r} ({type(cell).__name__}) has no 2-D `weight` or "
                              f"`wg` parameter; allowed: linear cells")
    return attention, linear


def attach_hooks(monitor, attention: Sequence, linear: Sequence, collecting: Callable[[], bool]) -> List:
    """Forward hooks recording into `monitor` (or a group: anything with `record`) while `collecting()` and the cell is in training mode."""
    handles = []
    for name, cell in attention:
        handles.append(cell.register_forward_hook(_attention_hook(monitor, f"{name}.attention", collecting)))
    for name, cell in linear:
        handles.append(cell.register_forward_hook(_linear_hook(monitor, f"{name}.linear", collecting)))
    return handles


def _attention_hook(monitor, row: str, collecting):
    def hook(cell, inputs, output):
        if not (cell.training and collecting()):
            return
        try:
            q, k = _query_and_key(cell, inputs)
            monitor.record(ATTENTION_HOOK, (row, q, k))
        except Exception as error:  # noqa: BLE001 - a monitor must not end the training
            warn_once(row, "mindmon: attention features of %s skipped: %s: %s", row, type(error).__name__, error)
    return hook


def _linear_hook(monitor, row: str, collecting):
    def hook(cell, inputs, output):
        if cell.training and collecting():
            monitor.record(LINEAR_HOOK, (row, linear_weight(cell)))
    return hook


def _query_and_key(cell, inputs):
    """Q and K as 4-D tensors in the configured layout. A 2-D (tokens, heads x head_dim) pair, as attention
    cores that flatten the batch take, is viewed as (tokens, 1, heads, head_dim) with the cell's `num_heads`
    (or `n_head`/`head_num`); that layout is "s,b,h,d"."""
    if len(inputs) < 2:
        raise ValueError(f"{len(inputs)} input(s); expected Q and K as the first two")
    q, k = inputs[0], inputs[1]
    if len(q.shape) == 2:
        heads = next((getattr(cell, a) for a in ("num_heads", "n_head", "head_num") if hasattr(cell, a)), None)
        if heads is None:
            raise ValueError("2-D Q and K and no num_heads attribute on the cell to split the heads")
        dim = q.shape[-1] // heads
        q, k = q.reshape(q.shape[0], 1, heads, dim), k.reshape(k.shape[0], 1, -1, dim)
    return q, k


def attach_l2_features(model, monitor: Optional[L2FeaturesMonitor] = None, sa_order: str = "s,b,h,d",
                       causal: bool = True, collecting: Optional[Callable[[], bool]] = None,
                       on_host: Optional[bool] = None, rank: int = 0):
    """L2 features on every attention cell (construct(q, k, ...)) and every linear cell (2-D weight/wg) of
    `model`, recorded into `monitor` (a group built with the L2 keys has one), or into a new monitor that
    the caller drives (`collect(step)` at each step end). Returns (monitor, handles)."""
    monitor = monitor if monitor is not None else L2FeaturesMonitor(sa_order, causal, on_host, rank)
    attention = [(n, c) for n, c in model.cells_and_names() if takes_query_and_key(c)]
    linear = [(n, c) for n, c in model.cells_and_names() if linear_weight(c) is not None]
    return monitor, attach_hooks(monitor, attention, linear, collecting or (lambda: True))


def attach_l2_and_collectives(config, model, optimizer, l2_monitor, cc_monitor, collecting: Callable[[], bool],
                              recorder=None, grad_acc_steps: int = 1) -> List:
    """What `l2_targets`/`recording_l2_features` and `cc_distribution` of a TensorStatsConfig switch on:
    their hooks attached, recording into the monitors the factory built (through `recorder`, the group,
    when given). `optimizer` may be None (kj600's hook_modules alone): cc_log_only then stops at the
    model's forward that begins the second step of `grad_acc_steps` forwards. Returns handles whose `remove()`
    detaches. Everything that can be refused (cell names, a second collective watcher) is checked before
    any hook."""
    l2, cc = config.l2, config.cc
    cells = select_l2_cells(model, l2) if l2 is not None and l2.active else None
    handles: List = []
    try:
        _attach_collectives(config, cc, (model, optimizer, grad_acc_steps), cc_monitor, collecting, handles, recorder)
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    if cells is not None:
        attention, linear = cells
        handles += attach_hooks(recorder or l2_monitor, attention, linear, collecting)
        logger.info("mindmon: L2 features of %d attention and %d linear cells", len(attention), len(linear))
    return handles


def _attach_collectives(config, cc, steps, monitor, collecting, handles: List, recorder=None) -> None:
    """cc_distribution: the collective wrappers (and, with cc_log_only, the stop), appended to `handles` as
    they are made so that a refusal half-way leaves nothing behind."""
    from mindmon.features.collectives.hooks import CollectivePatch, StopAfterLogging
    from mindmon.core.optimizer_hooks import hook_optimizer_calls

    if cc is None or not cc.active:
        return
    if monitor is not None:
        monitor.ops = config.ops   # attached again (a reloaded configuration): the new ops
    patch = CollectivePatch(recorder or monitor, None if cc.log_only else monitor, cc, collecting)
    handles.append(patch)
    if cc.log_only:
        model, optimizer, grad_acc_steps = steps   # what ends a step: the optimizer's calls, or K forwards
        stop = StopAfterLogging(patch, grad_acc_steps)
        if optimizer is not None:
            handles += hook_optimizer_calls(optimizer, stop.before_step, lambda *unused: None)
        else:
            handles.append(model.register_forward_pre_hook(stop.before_forward))
