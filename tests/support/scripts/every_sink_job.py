"""msprobe's TrainerMon on a small MindSpore MLP writing every file sink at once, for the full-disk tests.

    python every_sink_job.py OUTPUT_DIR STEPS [FSIZE_LIMIT_BYTES [PAUSE_AT [DEAD_DATABASE_URL]]]

Sinks: msprobe's CSV (OUTPUT_DIR/csv/<run folder>/, one file per statistic point for the whole run),
the JSONL and the Arrow stream / Parquet file (OUTPUT_DIR/monitor/rank_0/) and TensorBoard
(OUTPUT_DIR/tensorboard/rank_0/). Prints `step <n>` after each step and `after train` once the
monitor is closed. With FSIZE_LIMIT_BYTES no file may grow past that size (a write beyond it fails
with EFBIG, as on a full disk; 0: no limit). With PAUSE_AT the job reads a line from standard input
after printing `step <PAUSE_AT>` (the test changes the folder meanwhile). With DEAD_DATABASE_URL an
alert sink dumps every non-zero value to anomaly.json and spools it for that unreachable database
(OUTPUT_DIR/monitor/anomaly_detected/rank0/).
"""
import json
import logging
import os
import resource
import signal
import sys

import numpy as np
from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[3]))  # run as a script: tests.support


CONFIG = {"targets": {}, "param_distribution": True, "wg_distribution": True, "format": "csv",
          "ops": ["min", "max", "norm", "mean"], "ndigits": 12, "step_count_per_record": 1000}


def alert_sink(monitor_dir: str, dead_url: str):
    from mindmon.features.alerts import AlertConfig, AlertSink

    return AlertSink(AlertConfig.parse("monitor.alert", {
        "rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 0.0}}], "dump": True,
        "inform": {"connection_str": dead_url, "queue_size": 1, "timeout": 1, "close_timeout": 0.5}}), monitor_dir)


def main(output_dir: str, steps: int, fsize_limit: int = 0, pause_at: int = 0, dead_url: str = "") -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(output_dir, "csv")
    import mindspore as ms
    from mindspore import nn, value_and_grad

    from mindmon.msprobe import TrainerMon
    from mindmon.sinks import JsonlSink
    from mindmon.sinks.columnar import ColumnarSink
    from mindmon.sinks.tensorboard import TensorBoardSink
    from tests.support.msprobe_reference import K, make_model, make_optimizer

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    config_path = os.path.join(output_dir, "monitor_config.json")
    with open(config_path, "w") as file:
        json.dump(CONFIG, file)
    monitor_dir = os.path.join(output_dir, "monitor")
    sinks = [JsonlSink(monitor_dir), ColumnarSink(monitor_dir), TensorBoardSink(os.path.join(output_dir, "tensorboard"))]
    sinks += [alert_sink(monitor_dir, dead_url)] if dead_url else []
    model = make_model()
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    monitor = TrainerMon(config_path, params_have_main_grad=False, extra_sinks=sinks)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    if fsize_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # an over-limit write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    loss_fn = nn.MSELoss()
    grad_fn = value_and_grad(lambda x, y: loss_fn(model(x), y) / K, None, optimizer.parameters)
    rng = np.random.default_rng(7)
    for step in range(1, steps + 1):
        summed = None
        for _ in range(K):
            x, y = rng.normal(size=(4, 4)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
            _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
            summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
        optimizer(summed)
        print(f"step {step}", flush=True)
        if step == pause_at:
            sys.stdin.readline()
    monitor.close()
    print("after train", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *[int(a) for a in sys.argv[3:5]], *sys.argv[5:6])
