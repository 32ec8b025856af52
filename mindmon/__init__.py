"""mindmon: training monitors for MindSpore and the MindFormers PyNative Trainer.

Importing this package is cheap: it does not import MindSpore or MindFormers (the autoload hook
imports it at interpreter start). The public names below load on first use.
"""
__version__ = "0.1.0"

_LAZY = {
    "MonitorGroup": ("mindmon.core.group", "MonitorGroup"),
    "build_group": ("mindmon.core.factory", "build_group"),
    "build_callbacks": ("mindmon.core.factory", "build_callbacks"),
    "assemble": ("mindmon.core.factory", "assemble"),
    "MonitorConfig": ("mindmon.config", "MonitorConfig"),
    "ConfigError": ("mindmon.config", "ConfigError"),
    "parse_sections": ("mindmon.features", "parse_sections"),
    "AccumulatingTrainStep": ("mindmon.loop.step", "AccumulatingTrainStep"),
    "split_batch": ("mindmon.loop.step", "split_batch"),
    "parameter_names": ("mindmon.core.names", "parameter_names"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'mindmon' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    return getattr(importlib.import_module(module_name), attr)
