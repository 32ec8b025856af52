"""Weights & Biases in offline mode: the run's values under the TensorBoard tags, written by W&B into
`<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb`, uploaded later by `wandb sync <that folder>`."""
from typing import Dict

from mindmon.core.engine import RunInfo
from mindmon.features.trackers.config import WandbConfig
from mindmon.features.trackers.worker import TrackerSink


class WandbSink(TrackerSink):
    NAME = "W&B"

    def __init__(self, section: WandbConfig, config: dict, directory: str, logger=None):
        super().__init__(section.close_timeout, logger)
        self.section = section
        self.config = config
        self.directory = directory
        self.run = None

    def start(self, run: RunInfo) -> None:
        import os

        from mindmon.extras import require

        wandb = require("wandb", "wandb")
        os.makedirs(self.directory, exist_ok=True)
        # No console capture, system metrics, code or git: W&B's own threads would sample the machine and
        # copy the training's output; mindmon sends only its records.
        settings = wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False,
                                  silent=True)
        self.run = wandb.init(mode="offline", project=self.section.project, name=self.section.run_name,
                              dir=self.directory, config=self.config, settings=settings, reinit="create_new")
        self.logger.info("mindmon: W&B offline run in %s (upload with `wandb sync`)", self.run.dir)

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        self.run.finish()

    def abandon(self) -> None:
        """After a failure, W&B's service may be gone: its connection is closed now, so that nothing of it is
        left for the interpreter's exit."""
        import wandb

        try:
            if self.run is not None:
                self.run.finish(exit_code=1)
        finally:
            wandb.teardown()
