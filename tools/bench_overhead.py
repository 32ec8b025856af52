"""What mindmon's monitors cost per training step, measured in one process on the demo model.

The demo MoE GPT is trained through `AccumulatingTrainStep` + `MonitorGroup` (the code path the
MindFormers integration wraps) under several monitoring configurations. After warm-up, the
configurations take turns, a block of steps each, round after round, so that drift of a shared
machine (other processes, thermal state) falls on all of them alike. A step is timed from the
micro-batch split to the end of the step-end work (group flush, MaxLogitsMonitor).

Usage (from the repository root; about 8 minutes on a 2-core CPU):
    PYTHONPATH=. .venv/bin/python tools/bench_overhead.py --json bench_overhead.json
    PYTHONPATH=. .venv/bin/python tools/bench_overhead.py --tiny --rounds 1 --steps-per-block 1 --warmup 1 \
        --scaling-layers 2 --json /tmp/b.json          # seconds: proves it runs, measures nothing

Configurations:
    off                 group=None, model-side max-logit tracking off
    train_state         local_norm True, local_loss, device_norm True, device_loss (every parameter)
    +moe+max_logits     train_state + tokens per expert every micro-step + MaxLogitsMonitor every step
    host_sync_ref       REFERENCE, benchmark only: train_state's records, but each parameter's norm taken
                        by a MindSpore op and turned into a Python float in the record call (one host
                        sync per parameter per micro-step, as the upstream MindFormers hook does)
    tensor_stats        msprobe's TrainerMon statistics (six ops) of every parameter, gradient and Adam moment
    activations         msprobe's TrainerMon statistics of every cell's inputs and outputs and their gradients
    activations_idle    the same TrainerMon, but no step collected: what a step it skips costs (forward
                        hooks and pre-hooks stay; gradient hooks exist only on a collected forward's tensors)
    l2_features         attention entropy / softmax max and stable rank of every attention and linear cell
    speed               the speed feature (step time, tokens/s, memory, stragglers), flops off
    speed+flops         the same with its flops counted (MFU)
    off@device, train_state@device, tensor_stats@device
                        the device path (`on_host=False`), as off the CPU: the training step sums gradients
                        with MindSpore ops and the statistics are MindSpore operations; on CPU each is a
                        real kernel launch. Their time is set against the host path's rows of the same name
Every configuration's kernels per step are counted in one more step (MindSpore's profiler records each
kernel it launches: mindmon/kernels/dispatches.py), and what the monitoring adds over the step of `off` on the
same path (`off@device` for the device path's). The counts are exact; the times depend on the machine's load.
The scaling run repeats off / train_state at several layer counts. With tensor_stats in the run, the
table also gives its memory floor: what numpy takes for the memory work those statistics need (the sum
of the micro-batch gradients, one read of each point's arrays), as a share of the off step; with
activations in the run, theirs (one read of every activation and gradient a step collects). Under each
floor: what the configuration's time in mindmon is made of (the compiled adds and reads, MindSpore's
HookBackward markers, the rest), timed in the same steps, each against the floor's part it matches; for the
adds also numpy's sum in the order a step's micro-batches arrive (the caches emptied between them, as the
backward pass between two micro-batches empties them), the order a monitor that keeps no gradient must add in.
The sequence run (512 tokens by default) repeats off / train_state and `--seq-configs` (tensor_stats by default)
with longer sequences, each statistics configuration against its own floor measured at that length.
"""
import argparse
import gc
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mindmon.features.speed.memory import reset_peak_rss, status_bytes  # noqa: E402  (after the path)


# The main run's demo model (DemoModelConfig keys): every expert runs on every token, so a step is
# about 6 x parameters x tokens flops of real compute. 4 layers + 1 MTP layer, 10.6M parameters.
BENCH_MODEL = {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 4,
               "seq_length": 128, "num_experts": 8, "moe_router_topk": 2, "vocab_size": 1024,
               "first_moe_layer": 1, "mtp_num_layers": 1}
TINY_MODEL = {**BENCH_MODEL, "num_layers": 2, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2,
              "seq_length": 8, "num_experts": 4, "vocab_size": 32}


@dataclass
class BenchSize:
    """The demo model's sizes and the batch: K = `micro_steps` micro-batches of `micro_batch` sequences."""

    model: dict
    micro_batch: int = 2
    micro_steps: int = 4

    def with_model(self, **changes) -> "BenchSize":
        return replace(self, model={**self.model, **changes})


TINY = BenchSize(TINY_MODEL, micro_batch=1, micro_steps=2)

TRAIN_STATE = {"local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True}


class Workload:
    """One demo model, its optimizer and one fixed global batch, shared by every configuration."""

    def __init__(self, size: BenchSize, optimizer: str = "AdamWeightDecay"):
        from mindspore import Tensor, nn
        from mindspore.experimental.optim import AdamW

        from mindmon.demo.data import make_sequences
        from mindmon.demo.model import DemoModelConfig, DemoMoEGPT

        self.size = size
        self.config = DemoModelConfig(**size.model)
        self.model = DemoMoEGPT(self.config)
        self.model.set_train(True)
        # AdamW: mindspore.experimental.optim's, the optimizer msprobe's TrainerMon hooks on CPU.
        self.optimizer = (AdamW(self.model.trainable_params(), lr=1e-4) if optimizer == "AdamW" else
                          nn.AdamWeightDecay(self.model.trainable_params(), learning_rate=1e-4))
        sequences = make_sequences(size.micro_batch * size.micro_steps, self.config.seq_length,
                                   self.config.vocab_size)
        self.batch = (Tensor(sequences[:, :-1]), Tensor(sequences[:, 1:]))
        self.parameter_names = [p.name for p in self.optimizer.parameters]

    def loss(self, input_ids, labels):
        return self.model(input_ids, labels)[0]

    def describe(self) -> dict:
        params = self.optimizer.parameters
        return {**asdict(self.config), "micro_batch": self.size.micro_batch, "micro_steps": self.size.micro_steps,
                "parameters": int(sum(p.size for p in params)), "parameter_tensors": len(params)}


class HostSyncPerParameterNorms:
    """REFERENCE ONLY (the strategy mindmon avoids): one MindSpore norm op and one host read per tensor.

    Stands in for `SquaredNorms` inside a TrainStateMonitor, so the records are the same as
    train_state's and only the way the norms are taken differs.
    """

    def __init__(self):
        self._pending: Dict = {}

    def add(self, key, tensors) -> None:
        from mindspore import Tensor, ops

        # The training step may hand numpy views of the gradients (CPU): as tensors again, zero-copy.
        tensors = [Tensor.from_numpy(t) if isinstance(t, np.ndarray) else t for t in tensors]
        self._pending[key] = np.array([float(ops.norm(t)) ** 2 for t in tensors], dtype=np.float64)

    def alias(self, key, existing) -> None:
        self._pending[key] = self._pending[existing]

    def results(self) -> Dict:
        return dict(self._pending)

    def clear(self) -> None:
        self._pending.clear()


class TimedGroup:
    """Forwards the training step's calls to a MonitorGroup and adds up the seconds spent in them:
    during the step (its events) and at step end (flush)."""

    def __init__(self, group, own_norms: bool = False):
        self.group = group
        self.in_step = self.at_end = 0.0
        # The host-sync reference takes every norm itself: the training step must not take them while
        # adding (it would do work the reference does not use) nor hand them over.
        self.own_norms = own_norms

    def should_record(self, key: str) -> bool:
        return self.group.should_record(key) and not (self.own_norms and key == "local_norm")

    def should_take(self, event_type: type) -> bool:
        from mindmon.core.events import MicroBatchGradients

        return self.group.should_take(event_type) and not (self.own_norms and event_type is MicroBatchGradients)

    @property
    def active(self) -> bool:
        return self.group.active

    def _timed(self, during_step: bool, method, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            if during_step:
                self.in_step += time.perf_counter() - start
            else:
                self.at_end += time.perf_counter() - start

    def reset(self) -> None:
        self._timed(True, self.group.reset)

    def record(self, key, value=None, context=None) -> None:
        if self.own_norms and key == "local_norm":
            value = replace(value, squared_norms=None)
        self._timed(True, self.group.record, key, value, context)

    def emit(self, event) -> None:
        from mindmon.core.events import MicroBatchGradients

        if self.own_norms and isinstance(event, MicroBatchGradients):
            event = MicroBatchGradients(event.micro_step, replace(event.gradients, squared_norms=None))
        self._timed(True, self.group.emit, event)

    def set_max_norm(self, max_norm: float) -> None:
        self.group.set_max_norm(max_norm)

    def flush(self, step: int, **step_values) -> None:
        self._timed(False, self.group.flush, step, **step_values)

    def should_skip_update(self, grad_norm: float) -> bool:
        return self.group.should_skip_update(grad_norm)


def _build_group(name: str, work: "Workload", out_dir: Path, monitor: Optional[dict], max_logits: bool,
                 host_sync_norms: bool, on_host: bool = True):
    from mindmon import build_group, parse_sections
    from mindmon.core.factory import build
    from mindmon.features.train_state.monitor import TrainStateMonitor
    from mindmon.core.group import MonitorGroup

    logger = _file_logger(name, out_dir / name / "info.log")
    callbacks = [{"type": "MaxLogitsMonitor", "step_interval": 1}] if max_logits else []
    config = parse_sections({"monitor": {"output_dir": str(out_dir / name), **(monitor or {})},
                             "callbacks": callbacks})
    if host_sync_norms:   # the only difference from train_state: how the same squared norms are taken
        state = TrainStateMonitor(config.monitor.train_state, work.parameter_names, 0, True,
                                  norms=HostSyncPerParameterNorms())
        sinks = build(parse_sections({"monitor": {"output_dir": str(out_dir / name)}}), rank=0, logger=logger).sinks
        return MonitorGroup([state], sinks, 0, logger)
    return build_group(config, model=work.model, parameter_names=work.parameter_names, rank=0, logger=logger,
                       on_host=on_host)


class Configuration:
    """A monitoring configuration: its own train step, group and step counter over the shared workload.
    `on_host=False`: the device path (the step's sums and the monitors' reductions as MindSpore ops)."""

    def __init__(self, name: str, work: Workload, out_dir: Path, monitor: Optional[dict] = None,
                 max_logits: bool = False, host_sync_norms: bool = False, read_loss: bool = True,
                 on_host: bool = True):
        from mindmon import AccumulatingTrainStep

        self.name, self.work, self.max_logits, self.read_loss = name, work, max_logits, read_loss
        self.group = None
        if monitor is not None or max_logits:
            group = _build_group(name, work, out_dir, monitor, max_logits, host_sync_norms, on_host)
            group.setup(max_steps=10 ** 6)
            self.group = TimedGroup(group, own_norms=host_sync_norms)
        self.train_step = AccumulatingTrainStep(work.loss, work.optimizer, work.size.micro_steps,
                                                group=self.group, max_norm=1.0, on_host=on_host)
        self.buffer_add = 0.0
        self._time_buffer_add()
        self.steps = 0

    def _time_buffer_add(self) -> None:
        """Time the CPU host buffer's add in every configuration: with monitoring on it also takes the
        norms (stats.py), so its extra time over `off`'s is mindmon's too."""
        host = self.train_step._host
        if host is None:
            return
        add = host.add

        def timed_add(*args, **kwargs):
            start = time.perf_counter()
            try:
                return add(*args, **kwargs)
            finally:
                self.buffer_add += time.perf_counter() - start
        host.add = timed_add

    def enter(self) -> None:
        """Put the shared model in this configuration's state (max-logit tracking on or off)."""
        model = self.work.model
        model.track_max_attention_logit = self.max_logits
        model.reset_max_attention_logit()

    def step(self) -> "StepTime":
        """One training step with its step-end work, as a training loop runs it: the loop reads its loss
        (MindFormers' LossCallback logs it every step), then the monitors flush."""
        from mindmon import split_batch

        start, cpu_start, collector_start = time.perf_counter(), time.process_time(), COLLECTOR.seconds
        if self.group is not None:
            self.group.in_step = self.group.at_end = 0.0
        self.buffer_add = 0.0
        self.steps += 1
        loss, _ = self.train_step(split_batch(self.work.batch, self.work.size.micro_steps))
        if self.read_loss:
            float(loss.asnumpy())
        if self.group is not None:
            self.group.flush(self.steps)
        in_step, at_end = (self.group.in_step, self.group.at_end) if self.group is not None else (0.0, 0.0)
        return StepTime(time.perf_counter() - start, time.process_time() - cpu_start, in_step, at_end,
                        self.buffer_add, COLLECTOR.seconds - collector_start)

    def close(self) -> None:
        if self.group is not None:
            self.group.group.close()


class HookTimer:
    """Seconds spent in TrainerMon's hook entry points this step: the gradient hooks and the optimizer's
    pre-hook during the step, its post-hook (records, CSV) at step end."""

    def __init__(self):
        self.in_step = self.at_end = 0.0

    def wrap(self, function, during_step: bool, drain_queue: bool = False):
        """`drain_queue`: first wait, untimed, for the kernels MindSpore has queued. Even with
        `pynative_synchronize` the optimizer's update is launched without waiting for it, and a host
        read of any tensor waits for everything queued: timed, the post-hook's first read of a parameter
        would count the optimizer's compute (about 75 ms here), which the unmonitored step does too."""
        from mindspore import runtime

        def timed(*args, **kwargs):
            if drain_queue:
                runtime.synchronize()
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                if during_step:
                    self.in_step += elapsed
                else:
                    self.at_end += elapsed
        return timed

    def wrap_python(self, hook, during_step: bool):
        """`wrap` for a hook written in Python. A built-in one (a list's `append`, which keeps a gradient for
        the closing hook to add) is left as it is: its own work is one C call, and a timing wrapper would
        add the Python frame it exists to avoid. What MindSpore spends calling it shows in the wall and
        CPU columns, not in mindmon's."""
        return hook if isinstance(hook, types.BuiltinMethodType) else self.wrap(hook, during_step)

    def instrument(self, monitor) -> None:
        """Before `set_monitor`: the tensor-statistics hooks it makes are timed from the moment they attach
        (bench-only instrumentation of the next TensorStatsHooks.attach, then the class is as it was)."""
        from mindmon.features.tensor_stats.hooks import TensorStatsHooks

        original, timer = TensorStatsHooks.attach, self

        def attach(hooks, *args, **kwargs):
            TensorStatsHooks.attach = original
            make_hook = hooks._gradient_hook
            hooks._gradient_hook = lambda index, name: timer.wrap_python(make_hook(index, name), True)
            hooks._before_update = timer.wrap(hooks._before_update, True)
            hooks._after_update = timer.wrap(hooks._after_update, False, drain_queue=True)
            return original(hooks, *args, **kwargs)

        TensorStatsHooks.attach = attach

    def instrument_cells(self) -> None:
        """The cell hooks of activation monitoring are made by ActivationHooks when TrainerMon attaches;
        this bench process times every one it makes (only the activations configuration makes any)."""
        from mindmon.features.tensor_stats.activations import ActivationHooks

        for factory in ("_forward_hook", "_input_hook"):
            make = getattr(ActivationHooks, factory)
            setattr(ActivationHooks, factory, lambda hooks, *args, make=make: self.wrap(make(hooks, *args), True))
        # The gradient hooks are objects made per tensor per forward: the method they call is timed, so
        # the bench adds no object of its own per tensor (that would change the cycle collector's work).
        ActivationHooks.record_gradient = self.wrap(ActivationHooks.record_gradient, True)


ALL_OPS = ["min", "max", "mean", "norm", "zeros", "nans"]


PARAMETER_STATS = {"param_distribution": True, "wg_distribution": True, "mv_distribution": True}
ACTIVATIONS = {"xy_distribution": True, "all_xy": True}


class TensorStatsConfiguration(Configuration):
    """msprobe's statistics through mindmon's TrainerMon (`monitored`: of every parameter, or the inputs
    and outputs of every cell and their gradients), every op. On a model of its own: TrainerMon hooks
    its optimizer instance and cells for the whole run."""

    def __init__(self, name: str, size: "BenchSize", out_dir: Path, monitored: dict, on_host: bool = True):
        from mindmon.msprobe import TrainerMon, parse_tensor_stats

        super().__init__(name, Workload(size), out_dir, on_host=on_host)
        os.environ["MONITOR_OUTPUT_DIR"] = str(out_dir / name)
        config = parse_tensor_stats({**monitored, "ops": ALL_OPS})
        self.timer = HookTimer()
        PARTS.install()
        with _device_path(on_host):
            self.monitor = TrainerMon.from_config(config, params_have_main_grad=False)
            self.timer.instrument(self.monitor)
            if monitored.get("xy_distribution"):
                self.timer.instrument_cells()
            self.monitor.set_monitor(self.work.model, size.micro_steps, self.work.optimizer)

    def step(self) -> "StepTime":
        self.timer.in_step = self.timer.at_end = 0.0
        parts = dict(PARTS.totals)
        timed = super().step()
        return replace(timed, in_step=self.timer.in_step, at_end=self.timer.at_end, parts=PARTS.since(parts))

    def close(self) -> None:
        self.monitor.close()


@contextmanager
def _device_path(on_host: bool):
    """Bench-only: with `on_host=False`, what TrainerMon builds in the block takes the device path, as it does
    where tensors are not in host memory (it asks `host_is_device` when its parts are built)."""
    from mindmon.kernels import stats

    asked = stats.host_is_device
    if not on_host:
        stats.host_is_device = lambda: False
    try:
        yield
    finally:
        stats.host_is_device = asked


class L2Configuration(Configuration):
    """L2 features on every attention and linear cell (attention entropy and softmax max, stable rank and
    kernel norm), recorded into a group with the usual sinks. On a model of its own: the forward hooks
    stay for the whole run. Its mindmon column adds the time inside those hooks."""

    def __init__(self, name: str, size: "BenchSize", out_dir: Path):
        from mindmon.features.l2 import hooks as l2_hooks

        super().__init__(name, Workload(size), out_dir, monitor={})
        self.timer = HookTimer()
        for factory in ("_attention_hook", "_linear_hook"):   # bench-only: time every hook they make
            make = getattr(l2_hooks, factory)
            setattr(l2_hooks, factory, lambda recorder, row, collecting, make=make:
                    self.timer.wrap(make(recorder, row, collecting), True))
        from mindmon.core.group import MonitorGroup

        monitor, _ = l2_hooks.attach_l2_features(self.work.model, on_host=True)
        built = self.group.group   # the same sinks, with the L2 features' monitor
        self.group.group = MonitorGroup([monitor], built.sinks, built.rank, built.logger)

    def step(self) -> "StepTime":
        self.timer.in_step = 0.0
        timed = super().step()
        return replace(timed, in_step=timed.in_step + self.timer.in_step)


def _file_logger(name: str, path: Path) -> logging.Logger:
    """The log lines go to a file, as MindFormers' info.log would take them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"mindmon.bench.{name}.{id(path)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(message)s"))
    logger.addHandler(handler)
    return logger


def _rss_kib(field: str) -> int:
    value = status_bytes(field)
    return -1 if value is None else int(value) // 1024


@dataclass
class StepTime:
    """Seconds: wall clock; CPU time of the whole process (all threads; other processes' load does not
    count, waiting does not count); wall clock inside mindmon's calls during the step (group
    reset/record: where the norm strategies differ) and at step end (group flush: collect + sinks,
    and the MaxLogitsMonitor callback); inside the CPU training step's gradient buffer add (every
    configuration; it takes the norms when monitoring is on). Model-side max-logit tracking is in none."""

    wall: float
    cpu: float
    in_step: float
    at_end: float
    buffer_add: float = 0.0
    collector: float = 0.0   # Python's cycle collector, whatever code it interrupted
    parts: Dict[str, float] = field(default_factory=dict)   # `PartClocks`' seconds (and calls) in this step

    @property
    def in_mindmon(self) -> float:
        return self.in_step + self.at_end


class CollectorClock:
    """Seconds Python's cycle collector has run in this process (`gc.callbacks`). The medians above miss a
    full collection that comes every few steps; the table shows this clock's mean per step (`gc ms mean`)."""

    def __init__(self):
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


COLLECTOR = CollectorClock()


class PartClocks:
    """Bench-only: seconds inside the parts of the statistics configurations' time in mindmon that have a
    memory floor to be set against. `reads`: the compiled calls that read tensors where they lie
    (`reductions_at`, `row_reductions_at` for strided ones); `adds`: the gradient sums' `adds_at` (with the
    statistics of the sums they finish); both with their hand-off to helper threads. `markers`: MindSpore's
    `HookBackward` ops, which `input_grad` puts before every monitored cell (their forward, recorded for the
    backward pass; `marker_calls` counts them). `read_elements`: the elements the reads were given (memory
    that several rows share is read once). Process-wide and installed once, by the first statistics
    configuration: a step reads the clocks' change. Each timed call costs a Python frame (about a
    microsecond), charged to the configuration that makes it."""

    NAMES = ("reads", "adds", "markers", "marker_calls", "read_elements")
    COUNTS = ("marker_calls", "read_elements")   # not seconds

    def __init__(self):
        self.totals = dict.fromkeys(self.NAMES, 0.0)
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        from mindspore import ops

        from mindmon.features.tensor_stats import accumulate, monitor
        monitor.reductions_at = self._timed(monitor.reductions_at, "reads", "read_elements",
                                            lambda table, *rest: int(table[2::4].sum()))
        monitor.row_reductions_at = self._timed(monitor.row_reductions_at, "reads", "read_elements",
                                                lambda table, *rest: int((table[2::5] * table[3::5]).sum()))
        accumulate.adds_at = self._timed(accumulate.adds_at, "adds")
        ops.HookBackward.__call__ = self._timed(ops.HookBackward.__call__, "markers", "marker_calls")

    def _timed(self, function, name: str, count: Optional[str] = None, amount: Callable = lambda *args: 1):
        """`function` timed into `name`; `count` adds up `amount(*args)` of each call (1: the calls)."""
        totals = self.totals

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
                if count is not None:
                    totals[count] += amount(*args)
        return timed

    def since(self, before: Dict[str, float]) -> Dict[str, float]:
        return {name: self.totals[name] - before[name] for name in self.NAMES}


PARTS = PartClocks()


@dataclass
class Samples:
    """One configuration's measurements: step times per round, peak-RSS rise per block (KiB)."""

    times: List[List[StepTime]]
    rss_rise_kib: List[int]
    python_peak_kib: Optional[float] = None
    # Whether its train step's buffer add takes norms (a group is attached): only then is that add's time
    # over `off`'s mindmon's. Without a group the add is `off`'s own code, and the difference of the two
    # medians only noise (the cost of mindmon evicting the add's memory from cache is in the wall ratio).
    norms_in_add: bool = True


def run_interleaved(configs: List[Configuration], rounds: int, steps_per_block: int, warmup: int,
                    log: Callable[[str], None], python_memory: bool = True) -> Dict[str, Samples]:
    """Warm every configuration up, then `rounds` rounds of one block per configuration; the order of
    the configurations rotates from round to round, so none always follows the same neighbour."""
    for config in configs:
        config.enter()
        for _ in range(warmup):
            config.step()
    samples = {c.name: Samples([], [], norms_in_add=c.group is not None) for c in configs}
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            config.enter()
            can_reset = reset_peak_rss()
            before = _rss_kib("VmRSS")
            times = [config.step() for _ in range(steps_per_block)]
            samples[config.name].times.append(times)
            if can_reset:
                samples[config.name].rss_rise_kib.append(_rss_kib("VmHWM") - before)
        log(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{c.name} {statistics.median(t.wall for t in samples[c.name].times[-1]):.3f}s" for c in configs))
    for config in configs if python_memory else []:
        samples[config.name].python_peak_kib = _python_peak_kib(config)
    return samples


def _python_peak_kib(config: Configuration) -> float:
    """Peak of Python-heap allocations (numpy arrays included) during one untimed step, by tracemalloc
    (it slows allocation down, so it never runs while steps are timed)."""
    config.enter()
    tracemalloc.start()
    try:
        config.step()
        return tracemalloc.get_traced_memory()[1] / 1024
    finally:
        tracemalloc.stop()


def _median(blocks: List[List[StepTime]], field: str) -> float:
    return statistics.median(getattr(t, field) for block in blocks for t in block)


def baseline_of(name: str, names) -> str:
    """The unmonitored configuration a configuration is set against: `off` on its own path."""
    return DEVICE_OFF if name.endswith(DEVICE) and DEVICE_OFF in names else "off"


def summarize(samples: Dict[str, Samples]) -> List[dict]:
    """Per configuration: median step time (wall and CPU) over all timed steps, their ratios to the
    baseline's (`baseline_of`), the spread of the per-round wall ratios, time inside mindmon's calls, and memory."""
    rows = []
    for name, s in samples.items():
        base = samples[baseline_of(name, samples)].times
        per_round = [_median([a], "wall") / _median([b], "wall") for a, b in zip(s.times, base)]
        rows.append({
            "config": name, "steps_timed": sum(len(b) for b in s.times),
            "median_step_s": _median(s.times, "wall"),
            "ratio_to_off": _median(s.times, "wall") / _median(base, "wall"),
            "min_step_s": min(t.wall for block in s.times for t in block),
            "min_ratio_to_off": min(t.wall for block in s.times for t in block) / min(
                t.wall for block in base for t in block),
            "added_ms_per_step": (_median(s.times, "wall") - _median(base, "wall")) * 1e3,
            "round_ratio_median": statistics.median(per_round),
            "round_ratio_min": min(per_round), "round_ratio_max": max(per_round),
            "median_cpu_s": _median(s.times, "cpu"),
            "cpu_ratio_to_off": _median(s.times, "cpu") / _median(base, "cpu"),
            **_in_mindmon(s.times, base, s.norms_in_add),
            "collector_ms_per_step_mean": statistics.mean(t.collector for block in s.times for t in block) * 1e3,
            "parts_per_step": _parts(s.times),
            "peak_rss_rise_mib": (statistics.median(s.rss_rise_kib) / 1024) if s.rss_rise_kib else None,
            "python_peak_mib": s.python_peak_kib / 1024 if s.python_peak_kib is not None else None,
        })
    return rows


def _parts(times: List[List[StepTime]]) -> Dict[str, float]:
    """Medians per step of `PartClocks`' parts (milliseconds; calls as counted), where a step has them."""
    steps = [t.parts for block in times for t in block if t.parts]
    if not steps:
        return {}
    return {name: statistics.median(p[name] for p in steps) * (1 if name in PartClocks.COUNTS else 1e3)
            for name in PartClocks.NAMES}


def _in_mindmon(times: List[List[StepTime]], base: List[List[StepTime]], norms_in_add: bool) -> dict:
    """Time inside mindmon per step: its calls during the step and at step end, plus, where the gradient
    buffer's add takes norms (`norms_in_add`), what it takes over `off`'s (never counted below zero)."""
    buffer_extra = max(_median(times, "buffer_add") - _median(base, "buffer_add"), 0.0) if norms_in_add else 0.0
    in_mindmon = _median(times, "in_mindmon") + buffer_extra
    return {"in_mindmon_ms_per_step": in_mindmon * 1e3, "in_step_ms_per_step": _median(times, "in_step") * 1e3,
            "buffer_add_extra_ms_per_step": buffer_extra * 1e3, "at_end_ms_per_step": _median(times, "at_end") * 1e3,
            "in_mindmon_share_of_off_step": in_mindmon / _median(base, "wall")}


# The device path's configurations: their names end in DEVICE; DEVICE_OFF is their unmonitored step.
DEVICE = "@device"
DEVICE_OFF = "off" + DEVICE


def count_step_kernels(config: Configuration) -> int:
    """The kernels MindSpore launches in one step of `config` (with its step-end work), as its profiler
    records them: exact, unlike a time."""
    from mindmon.kernels.dispatches import count_kernel_launches

    config.enter()
    with count_kernel_launches() as launched:
        config.step()
    return launched.count


def add_kernel_counts(rows: List[dict], kernels: Dict[str, int]) -> None:
    """Each row's kernels per step, and those over its baseline's (`baseline_of`): the monitoring's own."""
    for row in rows:
        row["kernels_per_step"] = kernels[row["config"]]
        row["mindmon_kernels_per_step"] = kernels[row["config"]] - kernels[baseline_of(row["config"], kernels)]


def _main_configs(work: Workload, out_dir: Path, only: Optional[Sequence[str]] = None) -> List[Configuration]:
    """The main run's configurations (with `only`: `off`, `train_state` and those named), in table order."""
    both = {"train_state": TRAIN_STATE, "moe_monitor": {"save_tokens_per_expert_interval": 1}}
    makers = {
        "off": lambda: Configuration("off", work, out_dir),
        "train_state": lambda: Configuration("train_state", work, out_dir, {"train_state": TRAIN_STATE}),
        "+moe+max_logits": lambda: Configuration("+moe+max_logits", work, out_dir, both, max_logits=True),
        "host_sync_ref": lambda: Configuration("host_sync_ref", work, out_dir, {"train_state": TRAIN_STATE},
                                               host_sync_norms=True),
        "tensor_stats": lambda: TensorStatsConfiguration("tensor_stats", work.size, out_dir, PARAMETER_STATS),
        "activations": lambda: TensorStatsConfiguration("activations", work.size, out_dir, ACTIVATIONS),
        # the same monitor, no step collected: what the steps it skips cost
        "activations_idle": lambda: TensorStatsConfiguration("activations_idle", work.size, out_dir,
                                                             {**ACTIVATIONS, "start_step": 10 ** 9}),
        "l2_features": lambda: L2Configuration("l2_features", work.size, out_dir),
        "speed": lambda: Configuration("speed", work, out_dir, {"speed": {"enabled": True}}),
        "speed+flops": lambda: Configuration("speed+flops", work, out_dir, {"speed": {"enabled": True, "flops": True}}),
        DEVICE_OFF: lambda: Configuration(DEVICE_OFF, work, out_dir, on_host=False),
        "train_state" + DEVICE: lambda: Configuration("train_state" + DEVICE, work, out_dir,
                                                      {"train_state": TRAIN_STATE}, on_host=False),
        "tensor_stats" + DEVICE: lambda: TensorStatsConfiguration("tensor_stats" + DEVICE, work.size, out_dir,
                                                                  PARAMETER_STATS, on_host=False),
    }
    wanted = {"off", "train_state", *only} if only else set(makers)
    if any(name.endswith(DEVICE) for name in wanted):
        wanted.add(DEVICE_OFF)
    return [make() for name, make in makers.items() if name in wanted]


def measure_norms_in_add(config: Configuration, repeats: int = 7) -> Optional[dict]:
    """train_state's `add` measured apart: the CPU gradient buffer's add of one step's K micro-batch
    gradients (captured from a step of `config`) without and with the norms, the two taking turns,
    fastest of `repeats` each. The main table's `add` is a difference of two medians of whole steps'
    adds (about 70 ms each, with a spread of 10-20 ms); this one adds the same arrays every time."""
    from mindmon.kernels.stats import HostGradientBuffer

    host = config.train_step._host
    if host is None:
        return None
    captured, timed_add = [], host.add
    host.add = lambda grads, with_norms=False: (captured.append(grads), timed_add(grads, with_norms))[1]
    try:
        config.enter()
        config.step()
    finally:
        host.add = timed_add
    parameters = config.work.optimizer.parameters
    best = {False: float("inf"), True: float("inf")}
    for _ in range(repeats):
        for with_norms in (False, True):
            buffer = HostGradientBuffer(parameters)
            start = time.perf_counter()
            for grads in captured:
                buffer.add(grads, with_norms)
            best[with_norms] = min(best[with_norms], time.perf_counter() - start)
    return {"add_ms": best[False] * 1e3, "add_with_norms_ms": best[True] * 1e3,
            "norms_ms": (best[True] - best[False]) * 1e3, "repeats": repeats}


def measure_statistics_floor(work: Workload, repeats: int = 7) -> dict:
    """The least memory work `tensor_stats` needs per step, whatever computes it, done by numpy on fresh
    float32 arrays of the model's parameter sizes (fastest of `repeats`): the sum of the K micro-batch
    gradients (`grad_unreduced` is the sum; a copy and K - 1 adds, numpy's own speed, each parameter's sum
    finished before the next is begun) and one read of each of the six points' arrays (`numpy_read`: any
    statistic reads at least that). Together the arrays are larger than the last-level cache, as in
    training, on the machines measured (32 MiB); with a larger cache part of them is read from it, and the
    floor is lower than a step's cold reads.
    Beside the floor, not in it: the same sum in the order a step's micro-batches arrive (every
    parameter's copy, then every parameter's second add, ...), the caches emptied before each micro-batch
    as its backward pass empties them (`_arriving_sums`), the order a monitor that keeps no gradient past
    its micro-batch adds in; and the read of the sums alone."""
    sizes = [int(np.prod(p.shape)) for p in work.optimizer.parameters]
    rng = np.random.default_rng(0)
    micro = [[rng.standard_normal(n, dtype=np.float32) for n in sizes] for _ in range(work.size.micro_steps)]
    sums = [np.empty(n, np.float32) for n in sizes]
    # the other five points: weights before and after the update, grad_reduced, Adam's two moments
    others = [[rng.standard_normal(n, dtype=np.float32) for n in sizes] for _ in range(5)]

    def gradient_sums():
        for i, total in enumerate(sums):
            np.copyto(total, micro[0][i])
            for gradients in micro[1:]:
                np.add(total, gradients[i], out=total)

    gradient_sum_ms = _fastest(gradient_sums, repeats)
    one_read_ms, reader = numpy_read([array for arrays in others + [sums] for array in arrays], repeats)
    sums_read_ms = _fastest(lambda: [READERS[reader](total) for total in sums], repeats)
    arriving_ms = min(_arriving_sums(micro, sums) for _ in range(repeats))
    return {"gradient_sum_ms": gradient_sum_ms, "one_read_ms": one_read_ms, "read_by": reader,
            "sums_read_ms": sums_read_ms, "gradient_sum_arriving_ms": arriving_ms,
            "floor_ms": gradient_sum_ms + one_read_ms, "repeats": repeats}


# numpy's ways of reading a float32 array whole. Which is fastest depends on the machine's BLAS and numpy's
# build: BLAS's dot led on an AMD EPYC; on a Xeon with a 300 MiB L3 numpy's max read 2.6x faster than dot.
READERS = {"dot": lambda array: np.dot(array, array), "max": np.maximum.reduce}


def numpy_read(arrays: Sequence[np.ndarray], repeats: int) -> Tuple[float, str]:
    """Milliseconds of the fastest of `repeats` reads of every one of `arrays` by the fastest of `READERS`
    (a floor: any statistic reads at least that), and that reader's name."""
    return min((_fastest(lambda: [read(array) for array in arrays], repeats), name)
               for name, read in READERS.items())


def _fastest(work_done: Callable[[], object], repeats: int) -> float:
    """Milliseconds of the fastest of `repeats` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work_done()
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def _arriving_sums(micro: List[List[np.ndarray]], sums: List[np.ndarray]) -> float:
    """Milliseconds numpy takes to sum the micro-batch gradients one micro-batch at a time, the caches
    emptied (untimed) before each."""
    flush = _cache_flusher()
    elapsed = 0.0
    for position, gradients in enumerate(micro):
        flush()
        start = time.perf_counter()
        for total, gradient in zip(sums, gradients):
            np.copyto(total, gradient) if position == 0 else np.add(total, gradient, out=total)
        elapsed += time.perf_counter() - start
    return elapsed * 1e3


def _cache_flusher() -> Callable[[], None]:
    """A call that reads twice the last-level cache (at least 64 MiB), leaving none of the caller's data there."""
    try:
        cache = os.sysconf("SC_LEVEL3_CACHE_SIZE") or os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError):   # no such name on this platform
        cache = 0
    data = np.ones(max(2 * cache, 64 << 20) // 4, np.float32)
    return lambda: np.dot(data, data)


def measure_activation_floor(out_dir: Path, repeats: int = 7) -> Optional[dict]:
    """The least memory work `activations` needs per step: one read (`numpy_read`) of every activation and
    activation gradient one collected step has rows for (their shapes from the last step's `actv` and
    `actv_grad` CSV files), on fresh float32 arrays of those sizes, fastest of `repeats`."""
    from mindmon.formats.msprobe_csv import read_csv

    sizes = []
    for point in ("actv", "actv_grad"):
        files = sorted(Path(out_dir / "activations").glob(f"*-rank0-*/{point}_[0-9]*.csv"),
                       key=lambda path: int(path.stem.rsplit("_", 1)[1].split("-")[0]))
        if files:
            sizes += [int(np.prod(record.shape)) for record in read_csv(str(files[-1]))]
    if not sizes:
        return None
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(n, dtype=np.float32) for n in sizes if n]
    best, reader = numpy_read(arrays, repeats)
    return {"tensors": len(sizes), "elements": int(sum(sizes)), "one_read_ms": best, "read_by": reader,
            "repeats": repeats}


def measure_floors(work: Workload, configs: Sequence, out_dir: Path) -> dict:
    """The memory floor of each statistics configuration among `configs` (None for one not run), measured
    while their models are alive, as the step ran."""
    names = {config.name for config in configs}
    return {"statistics_floor": measure_statistics_floor(work) if "tensor_stats" in names else None,
            "activation_floor": measure_activation_floor(out_dir) if "activations" in names else None}


def measure_main(size: BenchSize, args, out_dir: Path, log) -> dict:
    work = Workload(size)
    log(f"main run: {work.describe()}")
    configs = _main_configs(work, out_dir, args.only)
    samples = run_interleaved(configs, args.rounds, args.steps_per_block, args.warmup, log)
    norms_in_add = measure_norms_in_add(configs[1])
    floors = measure_floors(work, configs, out_dir)
    kernels = {config.name: count_step_kernels(config) for config in configs}
    for config in configs:
        config.close()
    rows = summarize(samples)
    add_kernel_counts(rows, kernels)
    off, ours = rows[0], rows[1]
    reference = next((r for r in rows if r["config"] == "host_sync_ref"), None)
    added = ours["added_ms_per_step"]
    result = {"size": work.describe(), "rows": rows, "off_median_step_s": off["median_step_s"],
              "norms_in_add": norms_in_add, **floors}
    if reference is None:
        return result
    # train_state's norms are taken in the buffer add (the reference's in its record calls): measured apart
    # where it can be, the difference of two noisy medians otherwise
    add = max(norms_in_add["norms_ms"], 0.0) if norms_in_add else ours["buffer_add_extra_ms_per_step"]
    in_step = ours["in_step_ms_per_step"] + add
    return {**result,
            # None: train_state's added wall time is not above zero, i.e. within the noise of this run
            "host_sync_added_over_train_state_added": reference["added_ms_per_step"] / added if added > 0 else None,
            "host_sync_in_mindmon_over_train_state_in_mindmon":
                reference["in_mindmon_ms_per_step"] / max(in_step + ours["at_end_ms_per_step"], 1e-9),
            "host_sync_in_step_over_train_state_in_step": reference["in_step_ms_per_step"] / max(in_step, 1e-9)}


def _off_and_train_state(work: Workload, out_dir: Path, rounds: int, warmup: int, log,
                         extra: Sequence[str] = ()) -> Tuple[List[dict], dict]:
    """off, train_state and the `extra` main-run configurations (on models of their own) on `work`'s size:
    their rows, and the memory floors of the statistics configurations among them (`measure_floors`)."""
    configs = _main_configs(work, out_dir, extra or ["train_state"])
    samples = run_interleaved(configs, rounds, 1, warmup, log, python_memory=False)
    norms_in_add = measure_norms_in_add(configs[1])
    floors = measure_floors(work, configs, out_dir)
    for config in configs:
        config.close()
    rows = summarize(samples)
    return [_norms_measured_apart(row, rows[0], norms_in_add) if row["config"] == "train_state" else row
            for row in rows], floors


def _norms_measured_apart(row: dict, off: dict, norms_in_add: Optional[dict]) -> dict:
    """train_state's row with its buffer add's norms as `measure_norms_in_add` measured them, not as the
    difference of two medians of a few steps' whole adds (at 512 tokens one run here charged 102 ms of
    noise to a cost measured apart at about 2 ms)."""
    if norms_in_add is None:
        return row
    extra = max(norms_in_add["norms_ms"], 0.0)
    in_mindmon = row["in_mindmon_ms_per_step"] - row["buffer_add_extra_ms_per_step"] + extra
    return {**row, "buffer_add_extra_ms_per_step": extra, "in_mindmon_ms_per_step": in_mindmon,
            "in_mindmon_share_of_off_step": in_mindmon / 1e3 / off["median_step_s"], "norms_in_add": norms_in_add}


def _sweep(work_sizes, key: str, folder: str, args, out_dir: Path, log, extra: Sequence[str] = ()) -> List[dict]:
    """off vs train_state (and `extra`) for each (value, size): one result per value, under `key`."""
    results = []
    for value, size in work_sizes:
        work = Workload(size)
        log(f"{key} run, {value}: {work.describe()}")
        rows, floors = _off_and_train_state(work, out_dir / f"{folder}{value}", args.scaling_rounds, args.warmup,
                                            log, extra)
        results.append({key: value, "size": work.describe(), "rows": rows, **floors})
    return results


def measure_scaling(size: BenchSize, args, out_dir: Path, log) -> List[dict]:
    return _sweep([(n, size.with_model(num_layers=n)) for n in args.scaling_layers], "num_layers", "L",
                  args, out_dir, log)


def measure_sequence(size: BenchSize, args, out_dir: Path, log) -> List[dict]:
    """The main model with longer sequences: more compute per parameter, the same monitoring work."""
    return _sweep([(n, size.with_model(seq_length=n)) for n in args.seq_lengths], "seq_length", "S",
                  args, out_dir, log, args.seq_configs)


def measure_peers(args, out_dir: Path, log) -> List[dict]:
    """mindmon's and msprobe's TrainerMon on the same msprobe-style loop and statistics, one process
    each (tools/bench_msprobe_peer.py). msprobe's row is there when `import msprobe.mindspore` works in
    this environment (pip install mindstudio-probe, plus its dependencies) after MindSpore, as the peer
    process imports them (msprobe first fails on MindSpore 2.9's protobuf descriptors)."""
    rows = []
    for monitored in args.peer_monitored:
        for implementation in ("mindmon", "msprobe"):
            importable = [sys.executable, "-c", "import mindspore, msprobe.mindspore"]
            if implementation == "msprobe" and subprocess.run(importable, capture_output=True).returncode:
                log("peer run: msprobe is not importable here; its row is left out")
                continue
            row = _peer_run(implementation, monitored, args, out_dir, log)
            if row is not None:
                rows.append(row)
    return rows


def _peer_run(implementation: str, monitored: str, args, out_dir: Path, log) -> Optional[dict]:
    """One peer process; its row, with the number of statistics its monitor reported failing (msprobe
    logs 'An error occurred while generating ... metrics' and leaves the rows out)."""
    script = Path(__file__).resolve().parent / "bench_msprobe_peer.py"
    log(f"peer run: {implementation}, {monitored}")
    done = subprocess.run([sys.executable, str(script), implementation,
                           str(out_dir / f"peer_{implementation}_{monitored}"), "--steps", str(args.peer_steps),
                           "--monitored", monitored] + (["--tiny"] if args.tiny else []),
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        log(f"peer run: {implementation} failed: {done.stderr[-500:]}")
        return None
    row = json.loads(lines[-1])
    row.update(ratio_to_off=row["on_median_s"] / row["off_median_s"],
               added_ms_per_step=(row["on_median_s"] - row["off_median_s"]) * 1e3,
               failed_statistics_logged=(done.stdout + done.stderr).count("An error occurred while generating"))
    return row


def _peer_lines(rows: List[dict]) -> List[str]:
    if not rows:
        return []
    lines = ["", "peers (msprobe-style loop; parameters: weights, gradients, Adam moments of every parameter; "
                 "activations: inputs and outputs of every cell and their gradients; ops min/max/mean/zeros/nans; "
                 "one process each, off then on; failures: statistics the monitor logged as failed):",
             f"{'TrainerMon':<12}{'monitored':<13}{'off step s':>12}{'on step s':>11}{'x off':>8}{'added ms':>10}"
             f"{'failures':>10}"]
    lines += [f"{r['implementation']:<12}{r.get('monitored', 'parameters'):<13}{r['off_median_s']:>12.3f}"
              f"{r['on_median_s']:>11.3f}{r['ratio_to_off']:>8.3f}{r['added_ms_per_step']:>10.1f}"
              f"{r.get('failed_statistics_logged', 0):>10}" for r in rows]
    return lines


def _norms_in_add_line(main: dict) -> List[str]:
    """train_state's share with its `add` measured apart (same gradients, fastest of several)."""
    apart = main.get("norms_in_add")
    if not apart:
        return []
    ours, off_step_ms = main["rows"][1], main["off_median_step_s"] * 1e3
    total = ours["in_step_ms_per_step"] + max(apart["norms_ms"], 0.0) + ours["at_end_ms_per_step"]
    return [f"train_state's add measured apart (same gradients, fastest of {apart['repeats']}): "
            f"{apart['add_ms']:.1f} ms without the norms, {apart['add_with_norms_ms']:.1f} ms with them: "
            f"{apart['norms_ms']:.1f} ms; step+add+end = {total:.1f} ms = {total / off_step_ms:.2%} of the off step"]


# Each memory floor the benchmark measures: the key of its numbers, the configuration it is the floor of,
# what it is made of, and its total.
FLOORS = (
    ("statistics_floor", "tensor_stats", "floor_ms",
     lambda f: f"the gradient sum {f['gradient_sum_ms']:.1f} ms + one read of the six points by numpy's "
               f"{f['read_by']} {f['one_read_ms']:.1f} ms"),
    ("activation_floor", "activations", "one_read_ms",
     lambda f: f"one read by numpy's {f['read_by']} of the {f['tensors']} activations and activation gradients "
               f"a step collects ({f['elements']:,} elements)"),
)


def _floor_lines(main: dict) -> List[str]:
    """Each floor against the time in mindmon of its configuration (and that configuration's wall ratio)."""
    lines, off_step_ms = [], main["off_median_step_s"] * 1e3
    for key, config, total, parts in FLOORS:
        floor = main.get(key)
        ours = next((row for row in main["rows"] if row["config"] == config), None)
        if not floor or ours is None:
            continue
        in_mindmon = ours["in_mindmon_ms_per_step"]
        lines.append(f"{config}' memory floor (numpy, fastest of {floor['repeats']}): {parts(floor)} = "
                     f"{floor[total]:.1f} ms = {floor[total] / off_step_ms:.2%} of the off step ({config} in mindmon: "
                     f"{in_mindmon:.1f} ms = {in_mindmon / off_step_ms:.2%}, {in_mindmon / floor[total]:.2f}x the "
                     f"floor; wall {ours['ratio_to_off']:.4f}x off)")
        lines += _parts_line(ours, floor, floor[total])
    return lines


def _parts_line(row: dict, floor: dict, floor_ms: float) -> List[str]:
    """What a statistics configuration's time in mindmon is made of (`PartClocks`), each part against the
    part of its floor it matches: the adds (which also read the sums they finish) against numpy's sum and
    read of the sums, the reads against the floor's other reads; the markers and the rest against the floor."""
    parts = row.get("parts_per_step")
    if not parts:
        return []
    rest = row["in_mindmon_ms_per_step"] - parts["reads"] - parts["adds"] - parts["markers"]
    pieces = []
    if parts["adds"]:
        adds, sums_read, arriving = parts["adds"], floor["sums_read_ms"], floor["gradient_sum_arriving_ms"]
        pieces.append(f"the compiled adds {adds:.1f} ms ({adds / (floor['gradient_sum_ms'] + sums_read):.2f}x numpy's "
                      f"sum and read of the sums, {adds / (arriving + sums_read):.2f}x with the sum in arrival order: "
                      f"{arriving:.1f} ms)")
    reads_floor = floor["one_read_ms"] - floor.get("sums_read_ms", 0.0)
    shared = ""
    if floor.get("elements") and parts.get("read_elements"):
        shared = (f"; they read {parts['read_elements']:,.0f} of the floor's {floor['elements']:,} elements: "
                  f"memory several rows share is read once")
    pieces.append(f"the compiled reads {parts['reads']:.1f} ms ({parts['reads'] / reads_floor:.2f}x numpy's read of "
                  f"them{shared})")
    if parts["marker_calls"]:
        pieces.append(f"MindSpore's HookBackward markers {parts['markers']:.1f} ms ({parts['markers'] / floor_ms:.2f}x "
                      f"the floor; {parts['marker_calls']:.0f} a step)")
    pieces.append(f"the rest {rest:.1f} ms ({rest / floor_ms:.2f}x the floor)")
    return ["    of it (medians of steps): " + ", ".join(pieces)]


def _reference_line(main: dict) -> List[str]:
    if "host_sync_added_over_train_state_added" not in main:
        return []
    wall = main["host_sync_added_over_train_state_added"]
    wall = f"{wall:.1f}x" if wall is not None else "n/a (train_state's is not above 0: noise)"
    apart = " (train_state's add measured apart)" if main.get("norms_in_add") else ""
    return [f"host_sync_ref / train_state{apart}: added wall time {wall}, "
            f"time in mindmon calls {main['host_sync_in_mindmon_over_train_state_in_mindmon']:.1f}x, "
            f"of which in the step (record calls + buffer add: where they differ) "
            f"{main['host_sync_in_step_over_train_state_in_step']:.1f}x"]


def format_tables(result: dict) -> str:
    head = (f"{'config':<17}{'median step s':>14}{'x off':>8}{'added ms':>10}{'round ratios min..max':>24}"
            f"{'min x off':>11}"
            f"{'CPU x off':>11}{'mindmon ms: step+add+end':>26}{'share of off':>14}{'gc ms mean':>12}"
            f"{'peak RSS rise MiB':>19}{'py peak MiB':>13}{'kernels/step':>14}{'mindmon kernels':>17}")
    lines = [f"main run ({result['main']['size']['parameters']:,} parameters in "
             f"{result['main']['size']['parameter_tensors']} tensors), rounds x steps per block = "
             f"{result['settings']['rounds']} x {result['settings']['steps_per_block']}", head]
    lines += [_row_line(r) for r in result["main"]["rows"]]
    main = result["main"]
    lines += _device_lines(main["rows"])
    lines += _norms_in_add_line(main)
    lines += _floor_lines(main)
    lines += _reference_line(main)
    if result["scaling"]:
        lines += ["", f"scaling (train_state vs off; hidden {result['scaling'][0]['size']['hidden_size']}):",
                  f"{'layers':>6}{'params':>12}{'tensors':>9}{'off step s':>12}{'train_state s':>15}{'x off':>8}"
                  f"{'added ms':>10}{'round ratios min..max':>24}{'CPU x off':>11}{'mindmon ms: step+add+end':>26}"]
        for run in result["scaling"]:
            off, ours = run["rows"]
            lines.append(f"{run['num_layers']:>6}{run['size']['parameters']:>12,}{run['size']['parameter_tensors']:>9}"
                         f"{off['median_step_s']:>12.3f}{ours['median_step_s']:>15.3f}{ours['ratio_to_off']:>8.4f}"
                         f"{ours['added_ms_per_step']:>10.1f}"
                         f"{ours['round_ratio_min']:>12.4f}..{ours['round_ratio_max']:<10.4f}"
                         f"{ours['cpu_ratio_to_off']:>11.4f}{_split(ours):>26}")
    lines += _sequence_lines(result.get("sequence") or [], result["main"])
    lines += _peer_lines(result.get("peers") or [])
    return "\n".join(lines)


def _sequence_lines(runs: List[dict], main: dict) -> List[str]:
    """The share of the step in mindmon as the tokens per micro-batch grow (the main run's rows first), and a
    statistics configuration's time against its memory floor measured in the same run at the same size."""
    if not runs:
        return []
    names = [row["config"] for run in runs for row in run["rows"][1:]]
    lines = ["", "sequence length (vs off, main model; floor: the configuration's memory floor at that length):",
             f"{'tokens':>7}  {'config':<16}{'off step s':>10}{'x off':>8}{'mindmon ms':>12}{'share of off step':>19}"
             f"{'floor ms':>10}{'x floor':>9}"]
    main_rows = [_norms_measured_apart(row, main["rows"][0], main.get("norms_in_add"))
                 if row["config"] == "train_state" else row for row in main["rows"]]
    shown = [(main["size"]["seq_length"], main_rows, main)] + [(run["seq_length"], run["rows"], run) for run in runs]
    for tokens, rows, floors in shown:
        off = rows[0]
        for ours in (row for row in rows[1:] if row["config"] in names):
            in_mindmon, floor = ours["in_mindmon_ms_per_step"], floor_total_ms(floors, ours["config"])
            against = f"{floor:>10.1f}{in_mindmon / floor:>8.2f}x" if floor else ""
            lines.append(f"{tokens:>7}  {ours['config']:<16}{off['median_step_s']:>10.3f}{ours['ratio_to_off']:>8.4f}"
                         f"{in_mindmon:>12.1f}{in_mindmon / 1000 / off['median_step_s']:>18.2%}{against}")
    return lines


def floor_total_ms(floors: dict, config: str) -> Optional[float]:
    """The memory floor of configuration `config` among a run's `floors` (`measure_floors`), or None."""
    for key, floored, total, _ in FLOORS:
        if floored == config and floors.get(key):
            return floors[key][total]
    return None


def _split(row: dict) -> str:
    return (f"{row['in_step_ms_per_step']:.1f}+{row.get('buffer_add_extra_ms_per_step', 0.0):.1f}"
            f"+{row['at_end_ms_per_step']:.1f}")


def _row_line(row: dict) -> str:
    def mib(value):
        return f"{value:.1f}" if value is not None else "n/a"

    spread = f"{row['round_ratio_min']:.4f}..{row['round_ratio_max']:.4f}"
    return (f"{row['config']:<17}{row['median_step_s']:>14.3f}{row['ratio_to_off']:>8.4f}"
            f"{row['added_ms_per_step']:>10.1f}{spread:>24}{row['min_ratio_to_off']:>11.4f}{row['cpu_ratio_to_off']:>11.4f}"
            f"{_split(row):>26}{row['in_mindmon_share_of_off_step']:>14.2%}{row['collector_ms_per_step_mean']:>12.1f}"
            f"{mib(row['peak_rss_rise_mib']):>19}{mib(row['python_peak_mib']):>13}{row.get('kernels_per_step', -1):>14}"
            f"{row.get('mindmon_kernels_per_step', -1):>17}")


def _device_lines(rows: List[dict]) -> List[str]:
    """Each device-path configuration against the host path's of the same name: time per step, time in
    mindmon, kernels per step (the host path takes its statistics in numpy: no kernel)."""
    by_name = {row["config"]: row for row in rows}
    pairs = [(by_name[name], by_name.get(name[:-len(DEVICE)])) for name in by_name if name.endswith(DEVICE)]
    lines = [f"device path (on_host=False) against the host path: {dev['config']} {dev['median_step_s']:.3f} s a step = "
             f"{dev['median_step_s'] / host['median_step_s']:.3f}x {host['config']}'s {host['median_step_s']:.3f} s; "
             f"in mindmon {dev['in_mindmon_ms_per_step']:.1f} ms against {host['in_mindmon_ms_per_step']:.1f} ms; "
             f"kernels a step {dev.get('kernels_per_step')} against {host.get('kernels_per_step')}, of them the "
             f"monitoring's {dev.get('mindmon_kernels_per_step')} against {host.get('mindmon_kernels_per_step')}"
             for dev, host in pairs if host is not None]
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("bench_overhead.json"), help="where the results go")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the main run (one block per config each)")
    parser.add_argument("--steps-per-block", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration first")
    parser.add_argument("--layers", type=int, default=BENCH_MODEL["num_layers"], help="decoder layers of the main run")
    parser.add_argument("--scaling-layers", type=int, nargs="*", default=[2, 8, 32])
    parser.add_argument("--scaling-rounds", type=int, default=3, help="rounds of one step per configuration")
    parser.add_argument("--only", nargs="*", default=None,
                        help="main run: only off, train_state and these configurations (e.g. l2_features)")
    parser.add_argument("--peers", action="store_true",
                        help="also run the msprobe peer comparison (tools/bench_msprobe_peer.py)")
    parser.add_argument("--peer-steps", type=int, default=4, help="timed steps per phase of a peer run")
    parser.add_argument("--peer-monitored", nargs="+", choices=("parameters", "activations"),
                        default=["parameters"], help="what the peer runs monitor (each a pair of processes)")
    parser.add_argument("--seq-lengths", type=int, nargs="*", default=None,
                        help="sequence lengths of the sequence run (the main model, off vs train_state); "
                             "default 512, none with --tiny")
    parser.add_argument("--seq-configs", nargs="*", default=["tensor_stats"],
                        help="main-run configurations the sequence run measures besides train_state")
    parser.add_argument("--scaling-hidden", type=int, default=128,
                        help="hidden size of the scaling run (ffn = 2x); smaller than the main run's so 32 "
                             "layers fit the time budget")
    parser.add_argument("--tiny", action="store_true", help="a toy model (for tests; the numbers mean nothing)")
    parser.add_argument("--output-dir", type=Path, default=None, help="monitor outputs (default: a temp dir)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.seq_lengths is None:
        args.seq_lengths = [] if args.tiny else [512]
    import mindspore as ms

    # Synchronous PyNative: on a small CPU the asynchronous queue makes every step several times slower.
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    size = TINY if args.tiny else BenchSize(BENCH_MODEL).with_model(num_layers=args.layers)
    scaling_size = TINY if args.tiny else BenchSize(BENCH_MODEL).with_model(
        hidden_size=args.scaling_hidden, ffn_hidden_size=2 * args.scaling_hidden)
    out_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="mindmon-bench-"))
    started = time.perf_counter()

    def log(message):
        print(f"[{time.perf_counter() - started:6.0f}s] {message}", flush=True)

    result = {"settings": {"rounds": args.rounds, "steps_per_block": args.steps_per_block, "warmup": args.warmup,
                           "scaling_rounds": args.scaling_rounds, "pynative_synchronize": True,
                           "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg()},
              "main": measure_main(size, args, out_dir, log),
              "scaling": measure_scaling(scaling_size, args, out_dir, log),
              "sequence": measure_sequence(size, args, out_dir, log),
              "peers": measure_peers(args, out_dir, log) if args.peers else []}
    result["settings"]["load_average_at_end"] = os.getloadavg()
    result["settings"]["wall_s"] = time.perf_counter() - started
    result["settings"]["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(format_tables(result))
    print(f"written: {args.json} (monitor outputs under {out_dir}); {result['settings']['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
