"""MindFormers' graph-mode `monitor_config:` section (with `check_for_nan_in_loss_and_grad`): mapped onto
train_state, TensorBoard and the MaxLogitsMonitor callback when the config is parsed; its own statistics
(optimizer and weight state, stable rank, throughput), step guard and log lines when it is built."""
from mindmon.core.engine import Feature
from mindmon.features.monitor_config.build import build
from mindmon.features.monitor_config.config import apply_monitor_config

FEATURE = Feature("monitor_config", translate=apply_monitor_config, build=build,
                  example={"monitor_config": {"monitor_on": True, "local_loss_format": "log",
                                              "weight_state_format": "log", "check_for_global_norm": True,
                                              "global_norm_spike_threshold": 10.0}})
