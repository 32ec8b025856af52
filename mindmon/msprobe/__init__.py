"""msprobe's training-state monitor API, on mindmon: change `from msprobe.mindspore import TrainerMon`
to `from mindmon.msprobe import TrainerMon` and keep the config.json (see docs/msprobe.md)."""
from .config import TensorStatsConfig, load_config_json, parse_tensor_stats
from .trainer_mon import TrainerMon

__all__ = ["TensorStatsConfig", "TrainerMon", "load_config_json", "parse_tensor_stats"]
