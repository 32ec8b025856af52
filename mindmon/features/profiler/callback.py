"""ProfilerCallback: MindSpore Profiler over a window of global steps (docs/semantics.md, docs/profiler.md)."""
import glob
import logging
import os
from dataclasses import dataclass
from typing import Optional

from mindmon.features.profiler.config import ProfilerConfig
from mindmon.formats import run_folder
from mindmon.core.trainer_callbacks import TrainerCallback


@dataclass(frozen=True)
class ProfileWindow:
    """Where `[start_step, end_step]` (1-based global steps) falls in a run that begins after
    `steps_done` steps, in the terms of `mindspore.profiler.schedule`, whose step 0 is the first
    step this run trains. A resumed run keeps its global window; a window partly done before the
    resume is cut to what is left.

    Example:
        ProfileWindow.of(start=105, end=106, steps_done=100)  # ProfileWindow(first=105, last=106, skip_first=3, warmup=1)
    """

    first: int        # first global step recorded
    last: int         # last global step recorded
    skip_first: int   # schedule steps with no profiler at all
    warmup: int       # one schedule step that initialises the profiler before recording, when there is room

    @property
    def active(self) -> int:
        return self.last - self.first + 1

    @classmethod
    def of(cls, start: int, end: int, steps_done: int) -> Optional["ProfileWindow"]:
        """None when the whole window lies before the first step of this run."""
        first = max(start, steps_done + 1)
        if end < first:
            return None
        lead = first - (steps_done + 1)  # schedule steps before the first recorded one
        warmup = 1 if lead >= 1 else 0   # MindSpore warns that results skew without a warm-up step
        return cls(first, end, lead - warmup, warmup)


def profiler_level(level: int):
    """The documented int as a `mindspore.profiler.ProfilerLevel`; any other int is LevelNone."""
    from mindspore.profiler import ProfilerLevel

    return {0: ProfilerLevel.Level0, 1: ProfilerLevel.Level1, 2: ProfilerLevel.Level2}.get(level, ProfilerLevel.LevelNone)


def rank_dir(config: ProfilerConfig, rank: int) -> str:
    """`output_path/rank_<r>`, or `<cwd>/profile/rank_<r>` when `output_path` is None (absolute)."""
    root = config.output_path if config.output_path is not None else os.path.join(os.getcwd(), "profile")
    return run_folder.rank_dir(os.path.abspath(root), rank)


class ProfilerCallback(TrainerCallback):
    """Records the MindSpore Profiler between `start_step` and `end_step` (global steps, both
    included) and writes the analysed trace to `rank_dir(config, rank)`. Outside the window the
    profiler is off. If the profiler cannot run, it logs why and training goes on.

    MonitorGroup builds it from the `profiler:` section when `enable_profiling` is on and this
    rank is in `profiler_rank`; in a plain loop, call the events yourself:

        callback = ProfilerCallback(ProfilerConfig.parse("profiler", {"enable_profiling": True, "start_step": 3, "end_step": 4}))
        callback.on_train_begin(None, state)      # state.global_step = steps already done (0, or the resume step)
        for step in ...:
            callback.on_step_begin(None, state)
            train_one_step()
            state.global_step += 1
            callback.on_step_end(None, state)
        callback.on_train_end(None, state)
    """

    def __init__(self, config: ProfilerConfig, rank: int = 0, logger: Optional[logging.Logger] = None):
        self.config = config
        self.rank = rank
        self.logger = logger or logging.getLogger("mindmon")
        self.output_dir = rank_dir(config, rank)
        self.window: Optional[ProfileWindow] = None
        self.trace_dir: Optional[str] = None  # the `*_ascend_ms` folder, once written
        self._profile = None
        self._mstx_range = None
        if not config.level_is_valid:
            # MindSpore 2.9 accepts LevelNone only together with mstx (markers alone); otherwise it
            # resets it to Level0 with a warning of its own.
            self.logger.warning(f"mindmon: profiler.profiler_level: got {config.profiler_level}; the levels are "
                                f"0, 1 and 2, so it maps to LevelNone (as documented), which MindSpore collects "
                                f"only with mstx: True (step markers only) and otherwise runs as Level0")

    def on_train_begin(self, args, state, **kwargs):
        steps_done = getattr(state, "global_step", 0) or 0
        self.window = ProfileWindow.of(self.config.start_step, self.config.end_step, steps_done)
        if self.window is None:
            self.logger.warning(f"mindmon: profiler: the window (steps {self.config.start_step}-{self.config.end_step}) "
                                f"ends before this run's first step {steps_done + 1}; nothing is profiled")
            return
        self._check_writable()
        self._guarded("could not start", self._start)

    def _check_writable(self) -> None:
        """The same rule as every output: a folder that cannot be made is a ConfigError naming its key,
        before step 1 (a profiler that fails later is logged and switched off)."""
        from mindmon.sinks.lines import unwritable

        try:
            os.makedirs(self.output_dir, exist_ok=True)
        except (OSError, ValueError) as error:
            configured = self.config.output_path if self.config.output_path is not None else "./profile"
            raise unwritable("profiler.output_path", configured, self.output_dir, error) from None

    def on_step_begin(self, args, state, **kwargs):
        if self._profile is not None and self.config.mstx:
            self._guarded("could not mark the step", self._mark_begin, state.global_step + 1)

    def on_step_end(self, args, state, **kwargs):
        if self._profile is None:
            return
        if self._mstx_range is not None:
            self._guarded("could not mark the step", self._mark_end)
        self._guarded("failed", self._profile.step)
        if self.trace_dir is not None and self._profile is not None:  # the window is closed and written
            self._guarded("could not stop", self._profile.stop)
            self._profile = None

    def on_train_end(self, args, state, **kwargs):
        if self._profile is None:
            return
        step = getattr(state, "global_step", 0)
        if step < self.window.first:
            self.logger.warning(f"mindmon: profiler: training ended at step {step}, before the window "
                                f"(steps {self.window.first}-{self.window.last}); nothing is profiled")
        else:
            self.logger.warning(f"mindmon: profiler: training ended at step {step}, inside the window; "
                                f"the trace holds steps {self.window.first}-{step}")
            self.window = ProfileWindow(self.window.first, step, self.window.skip_first, self.window.warmup)
        self._guarded("could not stop", self._profile.stop)
        self._profile = None

    def _start(self) -> None:
        import mindspore
        from mindspore.profiler import (AicoreMetrics, ProfilerActivity, _ExperimentalConfig, profile, schedule,
                                        tensorboard_trace_handler)

        level = profiler_level(self.config.profiler_level)
        # Levels 1 and 2 reject AiCoreNone and MindSpore resets it to PipeUtilization with a
        # warning; asking for that directly gives the same profile without the warning.
        metrics = AicoreMetrics.PipeUtilization if self.config.profiler_level in (1, 2) else AicoreMetrics.AiCoreNone
        os.makedirs(self.output_dir, exist_ok=True)
        # The handler also tells MindSpore where to write, so it is made before `profile`.
        self._write_trace = tensorboard_trace_handler(dir_name=self.output_dir)
        self._profile = profile(
            activities=self._activities(mindspore.get_context("device_target"), ProfilerActivity),
            with_stack=self.config.with_stack, profile_memory=self.config.profile_memory,
            schedule=schedule(wait=0, warmup=self.window.warmup, active=self.window.active, repeat=1,
                              skip_first=self.window.skip_first),
            on_trace_ready=self._on_trace_ready,
            experimental_config=_ExperimentalConfig(profiler_level=level, aic_metrics=metrics, mstx=self.config.mstx))
        self.logger.info(f"mindmon: profiler: will record global steps {self.window.first}-{self.window.last} "
                         f"(level {level.value}) into {self.output_dir}")

    def _activities(self, device_target: str, activity):
        """NPU (+ host CPU when `profile_cpu`); with no NPU, the host CPU operators, whatever
        `profile_cpu` says (an NPU-only profile on a CPU machine writes nothing)."""
        if device_target == "Ascend":
            return [activity.NPU, activity.CPU] if self.config.profile_cpu else [activity.NPU]
        notes = ["profiling the host CPU operators"]
        if not self.config.profile_cpu:
            notes.append("profile_cpu: False is ignored")
        if self.config.mstx:
            notes.append("mstx step markers need an NPU and are not recorded")
        self.logger.warning(f"mindmon: profiler: no NPU here (device_target {device_target}); {'; '.join(notes)}")
        return [activity.CPU]

    def _on_trace_ready(self, prof) -> None:
        self._write_trace(prof)  # MindSpore analyses the raw data here (about a second on a small model)
        written = sorted(glob.glob(os.path.join(self.output_dir, "*_ascend_ms")), key=os.path.getmtime)
        self.trace_dir = written[-1] if written else self.output_dir
        self.logger.info(
            f"mindmon: profiler: steps {self.window.first}-{self.window.last} written to {self.trace_dir}; open "
            f"{os.path.join(self.trace_dir, 'ASCEND_PROFILER_OUTPUT', 'trace_view.json')} in https://ui.perfetto.dev "
            f"or chrome://tracing (MindStudio Insight opens the folder), or run: mindmon profile-summary {self.trace_dir}")

    def _mark_begin(self, step: int) -> None:
        from mindspore.profiler import mstx

        self._mstx_range = mstx.range_start(f"step {step}")

    def _mark_end(self) -> None:
        from mindspore.profiler import mstx

        range_id, self._mstx_range = self._mstx_range, None
        mstx.range_end(range_id)

    def _guarded(self, what: str, action, *args) -> None:
        try:
            action(*args)
        except Exception:  # the profiler is a diagnostic: it must never stop the training
            self.logger.exception(f"mindmon: profiler {what} and is switched off; training goes on")
            self._profile = None
