"""Sections written once: a section is a frozen dataclass whose fields carry their check, their default and
a docstring (the string literal right after the field); parsing, `to_dict()` and the key tables of the
docs (tools/config_reference.py) all follow from it.

Example:
    @dataclass(frozen=True)
    class StepTimeConfig(Section):
        enabled: bool = setting(False, boolean())
        '''Write each step's wall time.'''
        every: int = setting(1, integer(low=1))
        '''Write the steps that are multiples of N.'''

    StepTimeConfig.parse("monitor.step_time", {"every": 0})
    # ConfigError: monitor.step_time.every: got 0 (int); allowed: an int >= 1
"""
import ast
import dataclasses
import functools
import inspect
import math
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Iterator, Optional, Sequence, Set, Tuple

from mindmon.config.checks import (ConfigError, check_bool, check_directory, check_int, check_keys, check_one_of,
                                   check_positive_number, is_int, key_path, parse_ranks, type_error,
                                   value_error)


@dataclass(frozen=True)
class Check:
    """How one key's value is read: `run(path, value)` returns the parsed value or raises ConfigError;
    `kind` is the type as the reference shows it; `section` is the dataclass of a nested section."""

    kind: str
    run: Callable[[str, Any], Any]
    section: Optional[type] = None


@dataclass(frozen=True)
class Setting:
    check: Check
    key: Optional[str] = None          # the YAML key when it differs from the field's name
    null_is_default: bool = False      # `key: null` (YAML `~`) keeps the default, as MindFormers reads it
    shown_default: Optional[str] = None    # the default as the reference writes it, when its repr would mislead
    dump: Optional[Callable[[Any], Any]] = None   # the value as `to_dict()` writes it, when not the generic form


def setting(default: Any = dataclasses.MISSING, check: Optional[Check] = None, *, key: Optional[str] = None,
            null_is_default: bool = False, shown_default: Optional[str] = None,
            dump: Optional[Callable[[Any], Any]] = None):
    """A section's field read from its YAML key with `check`; without a default the key is required (its
    absence is checked as the value None, so the error names the key)."""
    return dataclasses.field(default=default,
                             metadata={"setting": Setting(check, key, null_is_default, shown_default, dump)})


def settings(cls: type) -> Iterator[Tuple[dataclasses.Field, Setting]]:
    """The fields of a section class read from YAML keys, in declaration order."""
    for item in dataclasses.fields(cls):
        if "setting" in item.metadata:
            yield item, item.metadata["setting"]


def key_of(item: dataclasses.Field, meta: Setting) -> str:
    return meta.key or item.name


def keys_of(cls: type) -> Tuple[str, ...]:
    return tuple(key_of(item, meta) for item, meta in settings(cls))


def parse_settings(cls: type, path: str, section: Dict[str, Any]) -> Dict[str, Any]:
    """The present keys of an already key-checked mapping, each through its check, by field name; a
    required key that is absent is checked as None."""
    out = {}
    for item, meta in settings(cls):
        key = key_of(item, meta)
        required = item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
        if key not in section and not required:
            continue
        value = section.get(key)
        if value is None and meta.null_is_default:
            continue
        out[item.name] = meta.check.run(key_path(path, key), value)
    return out


def parse_section(cls: type, path: str, raw: Any, **extra) -> Any:
    """The section `cls` from its YAML value (None when absent): unknown keys refused with the closest
    name, each key checked, then the section's own cross-key rules (`validate`)."""
    section = check_keys(path, raw, keys_of(cls))
    parsed = cls(**parse_settings(cls, path, section), **extra)
    parsed.validate(path, set(section))
    return parsed


def yaml_value(value: Any) -> Any:
    """A parsed value as the YAML would spell it (what `mindmon check-config` prints)."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "to_yaml"):
        return value.to_yaml()
    if isinstance(value, (frozenset, set)):
        return sorted(value)
    if isinstance(value, (tuple, list)):
        return [yaml_value(v) for v in value]
    return value


def section_dict(section: Any) -> dict:
    """Every key of the section with its value, defaults filled in."""
    out = {}
    for item, meta in settings(type(section)):
        value = getattr(section, item.name)
        out[key_of(item, meta)] = meta.dump(value) if meta.dump else yaml_value(value)
    return out


class Section:
    """The base of a section written with `setting` fields: one `parse(path, raw)` and a `to_dict()`."""

    # Keys documented by hand after the generated rows: a block another parser reads (msprobe's `alert`),
    # a top-level key read with the section.
    OTHER_KEYS: ClassVar[Tuple[str, ...]] = ()

    @classmethod
    def parse(cls, path: str, raw: Any):
        return parse_section(cls, path, raw)

    def validate(self, path: str, given: Set[str]) -> None:
        """Rules across keys (`given`: the keys the YAML set); raises ConfigError. None by default."""

    def to_dict(self) -> dict:
        return section_dict(self)


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> Dict[str, str]:
    """The attribute docstrings of a dataclass and its bases: the string literal after each field."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


# The checks. Each takes the `allowed` text of today's messages where a key's wording differs.

def boolean() -> Check:
    return Check("bool", check_bool)


def integer(low: Optional[int] = None, high: Optional[int] = None, allowed: Optional[str] = None,
            kind: Optional[str] = None) -> Check:
    if kind is None:
        kind = "int" + ("" if low is None else (f", {low}..{high}" if high is not None else f" >= {low}"))
    return Check(kind, lambda path, value: check_int(path, value, low, high, allowed))


def positive_int(allowed: str = "a positive int", type_allowed: Optional[str] = None) -> Check:
    """An int >= 1; `type_allowed` when a wrong type is told otherwise than a wrong value."""
    def run(path: str, value: Any) -> int:
        if not is_int(value):
            raise type_error(path, value, type_allowed or allowed)
        if value < 1:
            raise value_error(path, value, allowed)
        return value
    return Check("positive int", run)


def positive_number(allowed: str = "a finite number > 0", above: float = 0.0, below: float = math.inf,
                    kind: str = "number > 0") -> Check:
    """A finite number > 0; with `above`/`below`, also strictly between them (the value as a float)."""
    def run(path: str, value: Any) -> float:
        number = check_positive_number(path, value, allowed)
        if not above < number < below:
            raise ConfigError(f"{path}: got {number}; allowed: {allowed}")
        return number
    return Check(kind, run)


def one_of(choices: Sequence[Any]) -> Check:
    return Check(" or ".join(f"`{c}`" for c in choices), lambda path, value: check_one_of(path, value, choices))


def directory(allowed: str = "a non-empty directory path") -> Check:
    return Check("str", lambda path, value: check_directory(path, value, allowed))


def text(allowed: str = "a non-empty string") -> Check:
    def run(path: str, value: Any) -> str:
        if not isinstance(value, str) or not value or "\0" in value:
            raise type_error(path, value, allowed)
        return value
    return Check("str", run)


def ranks() -> Check:
    return Check("list[int] or None", parse_ranks)


def optional(check: Check) -> Check:
    """None, or what `check` allows."""
    return Check(f"{check.kind} or None", lambda path, value: None if value is None else check.run(path, value),
                 check.section)


def nested(cls: type) -> Check:
    """A nested section: its own keys, checked by its class (`key: ~` = every default)."""
    return Check("mapping", lambda path, value: cls.parse(path, value), cls)


def custom(kind: str, run: Callable[[str, Any], Any]) -> Check:
    """A check written for one key (a filter, a pattern, a list with its own rules)."""
    return Check(kind, run)
