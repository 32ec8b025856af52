"""The `profiler` section."""
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from mindmon.config import ConfigError, check_bool, check_directory, check_keys, is_int, parse_ranks, type_error, value_error


PROFILER_LEVELS = (0, 1, 2)


@dataclass(frozen=True)
class ProfilerConfig:
    """The `profiler` section. `profiler_level` outside 0/1/2 means LevelNone."""

    enable_profiling: bool = False
    start_step: int = 1
    end_step: int = 1
    output_path: Optional[str] = None
    profiler_rank: Optional[Tuple[int, ...]] = None
    profiler_level: int = 0
    mstx: bool = False
    profile_memory: bool = False
    profile_cpu: bool = True
    with_stack: bool = True

    KEYS = ("enable_profiling", "start_step", "end_step", "output_path", "profiler_rank", "profiler_level",
            "mstx", "profile_memory", "profile_cpu", "with_stack")

    @property
    def active(self) -> bool:
        return self.enable_profiling

    @property
    def level_is_valid(self) -> bool:
        return self.profiler_level in PROFILER_LEVELS

    def selects_rank(self, rank: int) -> bool:
        return self.profiler_rank is None or rank in self.profiler_rank

    @classmethod
    def parse(cls, section: Any, path: str = "profiler") -> "ProfilerConfig":
        section = check_keys(path, section, cls.KEYS)
        out = {k: check_bool(f"{path}.{k}", section[k])
               for k in ("enable_profiling", "mstx", "profile_memory", "profile_cpu", "with_stack") if k in section}
        for key in ("start_step", "end_step", "profiler_level"):
            if key in section and not is_int(section[key]):
                raise type_error(f"{path}.{key}", section[key], "an int")
        for key in ("start_step", "end_step"):
            if key in section and section[key] <= 0:
                raise value_error(f"{path}.{key}", section[key], "a positive int")
        if "start_step" in section and section["start_step"] != 1 and "end_step" not in section:
            raise ConfigError(f"{path}.end_step: missing while {path}.start_step is {section['start_step']}; "
                              f"allowed: an end_step >= start_step (the default end_step 1 would leave the window empty)")
        start, end = section.get("start_step", 1), section.get("end_step", 1)
        if end < start:
            raise ConfigError(f"{path}.end_step: got {end}, which is before {path}.start_step={start}; "
                              f"allowed: end_step >= start_step")
        out.update(start_step=start, end_step=end)
        if "profiler_level" in section:
            out["profiler_level"] = section["profiler_level"]
        output_path = section.get("output_path")
        if output_path is not None:
            output_path = check_directory(f"{path}.output_path", output_path, "None or a non-empty directory path")
        out["output_path"] = output_path
        out["profiler_rank"] = parse_ranks(f"{path}.profiler_rank", section.get("profiler_rank"))
        return cls(**out)

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.KEYS}
        out["profiler_rank"] = list(self.profiler_rank) if self.profiler_rank is not None else None
        return out
