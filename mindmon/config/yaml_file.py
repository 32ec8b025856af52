"""Reading a training YAML file safely: every way a file can be broken becomes one `ConfigFileError`
line naming the file, the line (when YAML knows it) and what is wrong, never a traceback.

Checked before any value is looked at:
- the bytes are UTF-8 text without NUL bytes;
- the YAML parses (syntax, tags the safe loader knows, aliases whose anchor exists);
- no mapping has a null key (`~:`), a key that is a list/mapping, or the same key twice;
- nesting stays within `MAX_DEPTH` levels, and aliases (`*name`) expand the document by at most
  `MAX_ALIAS_EXPANSION` nodes, so a small file of nested aliases cannot take minutes or gigabytes;
- `${...}` interpolations resolve (omegaconf), when the file has any.

Example:
    raw = load_yaml("train.yaml")   # a plain dict, interpolations resolved
    raw = read_yaml("train.yaml")   # a plain dict, `${...}` left as written
"""
from typing import Any, Dict, Optional

import yaml

from mindmon.config.checks import ConfigError

MAX_DEPTH = 32                  # MindFormers configs are under 8 levels; omegaconf overflows its stack near 80
MAX_ALIAS_EXPANSION = 100_000   # nodes that aliases may add to what the file spells out

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser: a 10 MB file in seconds, not minutes
_NULL_TAG = "tag:yaml.org,2002:null"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class ConfigFileError(ConfigError):
    """A configuration file cannot be read as a mapping of sections; `str()` names the file and line."""

    def __init__(self, file: str, what: str, line: Optional[int] = None):
        self.file, self.line, self.what = file, line, what
        super().__init__(f"{file}: line {line}: {what}" if line else f"{file}: {what}")


def _line_of(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def _read_text(path: str) -> str:
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ConfigFileError(path, f"not UTF-8 text (byte 0x{data[error.start]:02x}); allowed: a UTF-8 file",
                              line) from None
    if "\0" in text:
        raise ConfigFileError(path, "a NUL byte; allowed: text without NUL bytes", _line_of(text, text.index("\0")))
    return text.lstrip("\ufeff")


def _yaml_error(path: str, text: str, error: yaml.YAMLError) -> ConfigFileError:
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        what = error.problem or error.context or "not valid YAML"
        if error.context and error.problem:
            what = f"{what} ({error.context})"
        return ConfigFileError(path, f"{what}; allowed: YAML the safe loader reads",
                               mark.line + 1 if mark else None)
    if isinstance(error, yaml.reader.ReaderError):
        code = error.character if isinstance(error.character, int) else ord(error.character)
        return ConfigFileError(path, f"a control character (U+{code:04X}); allowed: printable text",
                               _line_of(text, error.position))
    return ConfigFileError(path, f"{str(error).splitlines()[0]}; allowed: YAML the safe loader reads")


class _TreeCheck:
    """One walk over the composed node graph (aliases are shared nodes): depth and expanded size
    per node are memoised, so the walk costs what the file spells out, not what it expands to."""

    def __init__(self, path: str):
        self.path = path
        self.sizes: Dict[int, tuple] = {}   # id(node) -> (expanded nodes, depth)
        self.open = set()                   # nodes on the current path: an alias back into one is a cycle

    def fail(self, node, what: str) -> ConfigFileError:
        return ConfigFileError(self.path, what, node.start_mark.line + 1 if node.start_mark else None)

    def visit(self, node, depth: int = 1) -> tuple:
        if depth > MAX_DEPTH:
            raise self.fail(node, f"nested deeper than {MAX_DEPTH} levels; allowed: at most {MAX_DEPTH}")
        if id(node) in self.open:
            raise self.fail(node, "an alias refers to a collection that contains it; allowed: non-recursive aliases")
        if id(node) in self.sizes:
            return self.sizes[id(node)]
        if isinstance(node, yaml.MappingNode):
            self._check_keys(node)
            children = [child for pair in node.value for child in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        self.open.add(id(node))
        results = [self.visit(child, depth + 1) for child in children]
        self.open.discard(id(node))
        size = (1 + sum(s for s, _ in results), 1 + max((d for _, d in results), default=0))
        self.sizes[id(node)] = size
        return size

    def _check_keys(self, node) -> None:
        seen = {}
        for key, _ in node.value:
            if key.tag == _MERGE_TAG:
                continue
            if not isinstance(key, yaml.ScalarNode):
                raise self.fail(key, "a list or mapping used as a key; allowed: scalar keys")
            if key.tag == _NULL_TAG:
                raise self.fail(key, f"a null key ({key.value or 'empty'!s}); allowed: named keys")
            if (key.tag, key.value) in seen:  # `1:` and `"1":` are different keys
                raise self.fail(key, f"key {key.value!r} appears twice (first on line {seen[key.tag, key.value]}); "
                                     f"allowed: each key once per mapping")
            seen[key.tag, key.value] = key.start_mark.line + 1


def _check_tree(path: str, root) -> None:
    check = _TreeCheck(path)
    expanded, _ = check.visit(root)
    added = expanded - len(check.sizes)
    if added > MAX_ALIAS_EXPANSION:
        raise ConfigFileError(path, f"aliases expand the document by {added} nodes; allowed: at most "
                                    f"{MAX_ALIAS_EXPANSION} (write the values out, or anchor fewer levels)")


def _parse(path: str, text: str) -> Any:
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_tree(path, root)
        return loader.construct_document(root)
    except yaml.YAMLError as error:
        raise _yaml_error(path, text, error) from None
    except RecursionError:  # the pure-Python parser, when the C one is missing
        raise ConfigFileError(path, f"nested too deeply; allowed: at most {MAX_DEPTH} levels") from None
    finally:
        loader.dispose()


def read_yaml(path: str) -> Dict[str, Any]:
    """The file as a plain dict of sections, after the checks in the module docstring; `${...}`
    interpolations are left as written. An empty file is an error (no sections)."""
    text = _read_text(path)
    data = _parse(path, text)
    if not isinstance(data, dict):
        raise ConfigFileError(path, f"the top level is {type(data).__name__}; allowed: a mapping of sections "
                                    f"(monitor:, training:, ...)")
    return data


def resolve_interpolations(path: str, data: Dict[str, Any]) -> Dict[str, Any]:
    """`${...}` resolved by omegaconf; an interpolation that points nowhere names its key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "<top level>"
        what = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigFileError(path, f"{key}: {what}; allowed: ${{...}} that names an existing key "
                                    f"(or a known resolver such as oc.env)") from None


def load_yaml(path: str) -> Dict[str, Any]:
    """A training YAML as a plain dict, with omegaconf `${...}` interpolations resolved."""
    data = read_yaml(path)
    # omegaconf only when there is something to resolve: it takes seconds on a large file.
    return resolve_interpolations(path, data) if _has_dollar(data) else data


def _has_dollar(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_has_dollar(k) or _has_dollar(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_dollar(v) for v in value)
    return False
