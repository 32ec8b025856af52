"""msprobe's training-state monitor API, on mindmon: change `from msprobe.mindspore import TrainerMon`
to `from mindmon.msprobe import TrainerMon` and keep the config.json (see docs/msprobe.md)."""
from mindmon.features.tensor_stats.config import TensorStatsConfig, load_config_json, parse_tensor_stats
from mindmon.features.tensor_stats.structure import StopTraining
from mindmon.msprobe.csv2tb import csv2tensorboard_by_step
from mindmon.msprobe.trainer_mon import TrainerMon
from mindmon.msprobe.trainer_v2 import TrainerMonitorV2

__all__ = ["StopTraining", "TensorStatsConfig", "TrainerMon", "TrainerMonitorV2", "csv2tensorboard_by_step", "load_config_json",
           "parse_tensor_stats"]
