"""Which parameters a norm switch selects (`local_norm: ["attention"]`, `True`, `False`)."""
from dataclasses import dataclass
from typing import Any, List, Tuple, Union

from mindmon.config.checks import type_error, value_error


@dataclass(frozen=True)
class ParamFilter:
    """Which parameters a norm switch selects: all trainable ones, those whose name contains any
    of `substrings`, or none (off)."""

    substrings: Tuple[str, ...] = ()
    everything: bool = False

    @property
    def enabled(self) -> bool:
        return self.everything or bool(self.substrings)

    def matches(self, name: str) -> bool:
        return self.everything or any(s in name for s in self.substrings)

    def to_yaml(self) -> Union[bool, List[str]]:
        return True if self.everything else (list(self.substrings) if self.substrings else False)

    @classmethod
    def parse(cls, path: str, value: Any) -> "ParamFilter":
        allowed = 'True (all trainable parameters), a name substring, a list of substrings, or ""/False (off)'
        if isinstance(value, bool):
            return cls(everything=value)
        if isinstance(value, str):
            return cls(substrings=(value,) if value else ())
        if isinstance(value, (list, tuple)):
            for item in value:
                if not isinstance(item, str):
                    raise type_error(f"{path} item", item, "strings only")
                if not item:
                    raise value_error(f"{path} item", item, "non-empty substrings (use True to select all)")
            return cls(substrings=tuple(value))
        raise type_error(path, value, allowed)
