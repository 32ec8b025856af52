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
