"""MLflow: the run's values as metrics (TensorBoard tags, the training step as MLflow's step), mindmon's
configuration as parameters, and at close the HTML report and the anomaly dumps as artifacts."""
import glob
import os
import re
import time
from typing import Dict, List

from mindmon.core.engine import RunInfo
from mindmon.features.trackers.config import MlflowConfig
from mindmon.features.trackers.worker import TrackerSink, flatten

METRICS_PER_BATCH = 1000   # MLflow's limits on one log_batch call
PARAMS_PER_BATCH = 100
PARAM_LENGTH = 6000
KEY_LENGTH = 250
REPORT_FILE = "report.html"
ANOMALY_DUMPS = os.path.join("anomaly_detected", "rank*", "anomaly.json")   # the alerts feature's dumps


def metric_key(tag: str) -> str:
    """MLflow accepts letters, digits, `_ - . / :` and spaces in a key, and no `..`-like path parts."""
    key = re.sub(r"[^/\w.\- :]", "_", tag)[:KEY_LENGTH]
    return "/".join(part if part not in ("", ".", "..") else "_" for part in key.split("/"))


class MlflowSink(TrackerSink):
    NAME = "MLflow"

    def __init__(self, section: MlflowConfig, config: dict, output_dir: str, logger=None):
        super().__init__(section.close_timeout, logger)
        self.section = section
        self.config = config          # mindmon's parsed configuration (to_dict): the run's parameters
        self.output_dir = output_dir
        self.client = None
        self.run_id = None
        self.artifacts: List[str] = []   # what close() uploaded

    def start(self, run: RunInfo) -> None:
        from mindmon.extras import require

        require("mlflow", "mlflow")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(self.section.tracking_uri)
        experiment = self.client.get_experiment_by_name(self.section.experiment)
        experiment_id = experiment.experiment_id if experiment is not None \
            else self.client.create_experiment(self.section.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=self.section.run_name).info.run_id
        params = [Param(metric_key(k), str(v)[:PARAM_LENGTH]) for k, v in flatten(self.config)]
        for start in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + PARAMS_PER_BATCH])
        self.logger.info("mindmon: MLflow run %s in experiment %r at %s", self.run_id, self.section.experiment,
                         self.section.tracking_uri)

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_key(tag), value, now, step) for tag, value in scalars.items()]
        for start in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + METRICS_PER_BATCH])

    def finish(self) -> None:
        if self.section.artifacts:
            for path, folder in self._artifact_files():
                self.client.log_artifact(self.run_id, path, folder)
                self.artifacts.append(os.path.join(folder, os.path.basename(path)) if folder else os.path.basename(path))
        self.client.set_terminated(self.run_id, "FINISHED")

    def abandon(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FAILED")

    def _artifact_files(self):
        """(path, artifact folder): the report, written now from the run's files, then each rank's dump."""
        report = self._report()
        files = [(report, "")] if report else []
        for dump in sorted(glob.glob(os.path.join(self.output_dir, ANOMALY_DUMPS))):
            files.append((dump, os.path.relpath(os.path.dirname(dump), self.output_dir)))
        return files

    def _report(self):
        """The HTML report of the run so far; without the analysis extras or readable files, none (said once)."""
        try:
            from mindmon.analysis.report import write_report

            return write_report(self.output_dir, os.path.join(self.output_dir, REPORT_FILE), progress=None)
        except Exception as error:   # a report is a bonus: the metrics and the dumps still go
            self.logger.warning("mindmon: MLflow: no report artifact (%s: %s)", type(error).__name__, error)
            return None
