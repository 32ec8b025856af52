"""The checks every configuration section uses, with one wording for every error:
`<key path>: got <value> (<type>); allowed: <what is allowed>`.

Example:
    section = check_keys("monitor.alert", raw, ("rules", "dump"))
    dump = check_bool("monitor.alert.dump", section.get("dump", False))
"""
import difflib
import math
from typing import Any, Dict, Optional, Sequence, Tuple


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names the key, the value and what is allowed."""


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value has the wrong type."""


MAX_SHOWN_VALUE = 120  # characters of a value an error message quotes: a 1e6-item list stays one short line


def short_repr(value: Any) -> str:
    """`repr(value)`, cut to MAX_SHOWN_VALUE characters with the item count when longer."""
    text = repr(value)
    if len(text) > MAX_SHOWN_VALUE:
        size = f"{len(value)} items" if isinstance(value, (list, tuple, dict)) else f"{len(text)} characters"
        text = f"{text[:MAX_SHOWN_VALUE - 20]}... ({size})"
    return text


def describe(value: Any) -> str:
    """A value as errors quote it: its short repr and its type."""
    return f"{short_repr(value)} ({type(value).__name__})"


def type_error(path: str, value: Any, allowed: str) -> ConfigTypeError:
    return ConfigTypeError(f"{path}: got {describe(value)}; allowed: {allowed}")


def value_error(path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{path}: got {describe(value)}; allowed: {allowed}")


def key_path(path: str, key: str) -> str:
    """`path.key`, or `key` at the top of a file (msprobe's config.json has no section name)."""
    return f"{path}.{key}" if path else key


def is_int(value: Any) -> bool:
    """An int that is not a bool (YAML's `true` is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_keys(path: str, section: Any, allowed: Sequence[str]) -> Dict[str, Any]:
    """The section as a dict ({} for None); an unknown key is an error naming it and the closest allowed one."""
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise type_error(path, section, f"a mapping with keys {list(allowed)}")
    unknown = [k for k in section if k not in allowed]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), [str(a) for a in allowed], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key_path(path, key)}: unknown key {key!r}{hint}; allowed keys: {list(allowed)}")
    return section


def check_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise type_error(path, value, "True or False")
    return value


def check_int(path: str, value: Any, low: Optional[int] = None, high: Optional[int] = None,
              allowed: Optional[str] = None) -> int:
    """An int in [low, high] (either bound may be open); a wrong type and a wrong value are told apart."""
    if allowed is None:
        allowed = ("an int" if low is None else f"an int >= {low}") + ("" if high is None else f" and <= {high}")
    if not is_int(value):
        raise type_error(path, value, allowed)
    if (low is not None and value < low) or (high is not None and value > high):
        raise value_error(path, value, allowed)
    return value


def check_positive_number(path: str, value: Any, allowed: str = "a finite number > 0") -> float:
    """A finite number > 0 (inf and nan are refused everywhere: no threshold or epsilon means them)."""
    if not is_number(value):
        raise type_error(path, value, allowed)
    if not (math.isfinite(value) and value > 0):
        raise value_error(path, value, allowed)
    return float(value)


def check_one_of(path: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise value_error(path, value, f"one of {list(choices)}")
    return value


def check_directory(path: str, value: Any, allowed: str) -> str:
    """A directory path: a non-empty string without NUL (the OS would refuse it only at the first write)."""
    if not isinstance(value, str) or not value:
        raise type_error(path, value, allowed)
    if "\0" in value:
        raise value_error(path, value, f"{allowed}, without NUL characters")
    return value


def parse_ranks(path: str, ranks: Any) -> Optional[Tuple[int, ...]]:
    """A rank selection: None = every rank, else a non-empty list of rank ids."""
    if ranks is None:
        return None
    if not isinstance(ranks, (list, tuple)) or not ranks or not all(is_int(r) and r >= 0 for r in ranks):
        raise value_error(path, ranks, "None (all ranks) or a non-empty list of rank ids >= 0")
    return tuple(ranks)


def describe_error(file: str, error: Exception) -> str:
    """`<file>: <message>` for a ConfigError or OSError about `file` (the file is named once)."""
    text = str(error) if not isinstance(error, OSError) else f"{error.strerror or error}"
    if getattr(error, "file", None) is not None or text.startswith(f"{file}:"):
        return text
    return f"{file}: {text}"
