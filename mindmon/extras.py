"""Optional dependencies: a feature that needs one says which `pip install mindmon[<extra>]` brings it."""
import importlib


class MissingExtraError(ImportError):
    """A feature's optional dependency is not installed."""


def require(extra: str, module: str):
    """The imported module, or MissingExtraError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtraError(f"mindmon: this feature needs {module.split('.')[0]} ({error}); install it with "
                                f"`pip install 'mindmon[{extra}]'`") from None


SUPPORTED_MINDSPORE = ((2, 7), (2, 11))   # from 2.7 (inclusive) up to 2.11 (exclusive)
_version_checked = False


def require_mindspore():
    """The mindspore module; a clear error when it is missing, one warning when its version is
    outside the supported range (mindmon does not install or replace MindSpore itself)."""
    global _version_checked
    try:
        import mindspore
    except ImportError:
        raise MissingExtraError("mindmon: MindSpore is not installed. Install the MindSpore build for your "
                                "hardware, or in a fresh CPU environment "
                                "`pip install 'mindmon[mindspore]'`") from None
    if not _version_checked:
        _version_checked = True
        low, high = SUPPORTED_MINDSPORE
        version = tuple(int(p) for p in mindspore.__version__.split(".")[:2] if p.isdigit())
        if not low <= version < high:
            import logging

            logging.getLogger("mindmon").warning(
                f"mindmon: MindSpore {mindspore.__version__} is outside the supported range "
                f"{'.'.join(map(str, low))} <= version < {'.'.join(map(str, high))}; monitoring may fail")
    return mindspore
