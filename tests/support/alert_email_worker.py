"""A process that finds NAMES anomalies a step, every 50 ms, and hands them to the `monitor.alert`
block in CONFIG (a YAML file), until it is killed; prints `step <s>` after each step's flush.

    python alert_email_worker.py OUTPUT_DIR CONFIG
"""
import logging
import sys
import time

import yaml

from mindmon.core.engine import RunInfo
from mindmon.features.alerts import AlertConfig, AlertSink
from mindmon.core.records import Record

NAMES = 5


def step_records(step):
    return [Record(step, None, 0, "device_norm", f"p{n}", float(step * 10 + n + 1)) for n in range(NAMES)]


def main(output_dir: str, config_path: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with open(config_path, encoding="utf-8") as f:
        section = yaml.safe_load(f)["monitor"]["alert"]
    sink = AlertSink(AlertConfig.parse("monitor.alert", section), output_dir)
    sink.open(RunInfo(rank=0))
    step = 0
    while True:
        step += 1
        sink.write(step_records(step))
        sink.flush()
        print(f"step {step}", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
