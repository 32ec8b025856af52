"""Dynamic on/off: with `DYNAMIC_MONITOR=True` in the environment, the config.json is watched while training.

At the end of every step (the optimizer call) the file's modification time is compared with the last one
seen (the first check always reads the file). When it changed, the file is read and validated:
  - `dynamic_on: true`  -> the new configuration is applied from the next step: hooks of capabilities it
    switches off are detached, the others attached, and `collect_times` counts from 0 again
    (`start_step` is ignored: collection starts at the next step, every `step_interval` steps);
  - `dynamic_on: false` (or absent) -> monitoring stops after this step, every capability hook detached;
  - broken JSON or an invalid value -> logged once (for this edit) and the running configuration stays.
When a dynamic run reaches `collect_times`, its hooks are detached and `dynamic_on: false` is written back
into the file (every other key kept as it was, in its order); setting it to true again restarts.
"""
import json
import logging
import os
import shutil
from typing import Optional

from mindmon.config import ConfigError
from mindmon.features.tensor_stats.config import TensorStatsConfig, parse_tensor_stats

logger = logging.getLogger("mindmon")

DYNAMIC_ENV = "DYNAMIC_MONITOR"


def dynamic_mode() -> bool:
    return os.environ.get(DYNAMIC_ENV, "").strip().lower() == "true"


class ConfigWatcher:
    """`poll()` returns the file's new validated configuration when it changed since the last call, else None."""

    def __init__(self, path: str):
        self.path = path
        self.mtime: Optional[float] = None

    def poll(self, step: int) -> Optional[TensorStatsConfig]:
        try:
            mtime = os.path.getmtime(self.path)
        except OSError as error:
            return self._refuse(step, f"cannot read it ({error.strerror})", None)
        if mtime == self.mtime:
            return None
        self.mtime = mtime
        try:
            with open(self.path, encoding="utf-8") as file:
                raw = json.load(file)
            return parse_tensor_stats(raw)
        except OSError as error:
            return self._refuse(step, f"cannot read it ({error.strerror})", mtime)
        except json.JSONDecodeError as error:
            return self._refuse(step, f"it is not valid JSON ({error})", mtime)
        except ConfigError as error:
            return self._refuse(step, str(error), mtime)

    def _refuse(self, step: int, why: str, mtime: Optional[float]) -> None:
        if mtime is not None or self.mtime != -1.0:
            logger.error("mindmon: DYNAMIC_MONITOR: %s changed after step %d but %s; the running configuration "
                         "stays", self.path, step, why)
        self.mtime = mtime if mtime is not None else -1.0
        return None

    def switch_off(self) -> None:
        """Writes `dynamic_on: false` into the file, keeping every other key and its order."""
        try:
            with open(self.path, encoding="utf-8") as file:
                raw = json.load(file)
            raw["dynamic_on"] = False
            temporary = f"{self.path}.mindmon-tmp"
            with open(temporary, "w", encoding="utf-8") as file:
                json.dump(raw, file, indent=2)
            shutil.copymode(self.path, temporary)
            os.replace(temporary, self.path)
            self.mtime = os.path.getmtime(self.path)
        except (OSError, ValueError, TypeError) as error:
            logger.warning("mindmon: DYNAMIC_MONITOR: could not write dynamic_on: false into %s (%s); monitoring "
                           "stopped anyway", self.path, error)
