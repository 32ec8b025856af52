"""Attach mindmon to MindFormers when, and only when, the PyNative trainer module is imported.

`mindmon-autoload.pth` in site-packages calls `install()` at interpreter start. That costs one
entry in `sys.meta_path` and imports neither MindSpore nor MindFormers (the same way coverage
and APM agents hook in). `MINDMON_AUTOLOAD=0` turns it off.
"""
import importlib.abc
import importlib.util
import logging
import os
import sys

TRAINER_MODULE = "mindformers.pynative.trainer.trainer"


def autoload_enabled() -> bool:
    """`MINDMON_AUTOLOAD=0` turns autoload off (the .pth line checks the same, before importing mindmon)."""
    return os.environ.get("MINDMON_AUTOLOAD") != "0"


class _TrainerImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when the trainer module is about to load, wraps its loader so that
    mindmon attaches right after the module body has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRAINER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            run_module_body = spec.loader.exec_module

            def exec_module(module):
                run_module_body(module)
                _attach()

            spec.loader.exec_module = exec_module
        return spec


def _attach() -> None:
    from mindmon.integrations import mindformers

    try:
        mindformers.enable()
    except mindformers.IntegrationError as error:
        logging.getLogger("mindmon").error("mindmon: not attached: %s", error)


def install() -> None:
    """Called from the .pth file; idempotent."""
    if not autoload_enabled():
        return
    if TRAINER_MODULE in sys.modules:
        _attach()
        return
    if not any(isinstance(finder, _TrainerImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TrainerImportHook())
