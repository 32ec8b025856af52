"""SwanLab in its offline or local mode: the run's values under the TensorBoard tags, written by SwanLab
into `<log_dir>/run-<time>-<id>/run-<id>.swanlab` (offline: uploaded later by `swanlab sync <that folder>`)."""
from typing import Dict

from mindmon.core.engine import RunInfo
from mindmon.features.trackers.config import SwanlabConfig
from mindmon.features.trackers.worker import TrackerSink


class SwanlabSink(TrackerSink):
    NAME = "SwanLab"

    def __init__(self, section: SwanlabConfig, config: dict, log_dir: str, logger=None):
        super().__init__(section.close_timeout, logger)
        self.section = section
        self.config = config
        self.log_dir = log_dir
        self.run = None

    def start(self, run: RunInfo) -> None:
        from mindmon.extras import require

        swanlab = require("swanlab", "swanlab")
        # The terminal proxy would copy the training's own output into the run; the probes sample the
        # machine on threads of SwanLab's: mindmon sends only its records.
        settings = swanlab.Settings(terminal={"proxy_type": "none"},
                                    probe={"hardware": False, "monitor": False, "git": False,
                                           "requirements": False, "conda": False})
        self.run = swanlab.init(mode=self.section.mode, project=self.section.project, name=self.section.experiment,
                                log_dir=self.log_dir, config=self.config, settings=settings, reinit=True)
        self.logger.info("mindmon: SwanLab %s run in %s", self.section.mode, self.log_dir)

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        self.run.finish()

    def abandon(self) -> None:
        if self.run is not None:
            self.run.finish(state="crashed", error="mindmon: the SwanLab sink failed")
