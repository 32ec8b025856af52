"""The `profiler` section."""
from dataclasses import dataclass
from typing import Optional, Set, Tuple

from mindmon.config import ConfigError, Section, setting
from mindmon.config.fields import boolean, directory, integer, optional, positive_int, ranks


PROFILER_LEVELS = (0, 1, 2)


@dataclass(frozen=True)
class ProfilerConfig(Section):
    """The `profiler` section. `profiler_level` outside 0/1/2 means LevelNone."""

    enable_profiling: bool = setting(False, boolean())
    """Switches the profiler on."""

    start_step: int = setting(1, positive_int(type_allowed="an int"))
    """First global step recorded (1-based, the step the training log line counts)."""

    end_step: int = setting(1, positive_int(type_allowed="an int"))
    """Last global step recorded, >= `start_step`; must be set when `start_step` is not 1."""

    output_path: Optional[str] = setting(None, optional(directory("None or a non-empty directory path")),
                                         shown_default="`None` (= `<cwd>/profile`)")
    """The trace goes to `<output_path>/rank_<r>/` (a relative path is relative to the working directory)."""

    profiler_rank: Optional[Tuple[int, ...]] = setting(None, ranks(), shown_default="`None` (all ranks)")
    """Ranks that profile."""

    profiler_level: int = setting(0, integer(allowed="an int"))
    """`ProfilerLevel.Level0/1/2`; any other int maps to `LevelNone` with a warning (MindSpore 2.9 keeps
    `LevelNone` only with `mstx: True`, otherwise it runs `Level0`)."""

    mstx: bool = setting(False, boolean())
    """Passed to `_ExperimentalConfig`, and one `mstx` range marker per step (`step N`); markers need an NPU."""

    profile_memory: bool = setting(False, boolean())
    """Tensor memory."""

    profile_cpu: bool = setting(True, boolean())
    """Host CPU activity next to the NPU's."""

    with_stack: bool = setting(True, boolean())
    """Python call stacks."""

    @property
    def active(self) -> bool:
        return self.enable_profiling

    @property
    def level_is_valid(self) -> bool:
        return self.profiler_level in PROFILER_LEVELS

    def selects_rank(self, rank: int) -> bool:
        return self.profiler_rank is None or rank in self.profiler_rank

    def validate(self, path: str, given: Set[str]) -> None:
        if "start_step" in given and self.start_step != 1 and "end_step" not in given:
            raise ConfigError(f"{path}.end_step: missing while {path}.start_step is {self.start_step}; "
                              f"allowed: an end_step >= start_step (the default end_step 1 would leave the window empty)")
        if self.end_step < self.start_step:
            raise ConfigError(f"{path}.end_step: got {self.end_step}, which is before {path}.start_step="
                              f"{self.start_step}; allowed: end_step >= start_step")
