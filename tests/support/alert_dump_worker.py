"""A process that dumps an alert storm until it is killed: every value of PARAMETERS x 6 statistics
fires at every step; after each step's flush it prints `step <s>` (the step is then in the file)."""
import logging
import sys

from mindmon.features.alerts import AlertConfig, AlertSink
from mindmon.core.records import Record

STATISTICS = ("norm", "min", "max", "mean", "zeros", "nans")


def step_records(step: int, parameters: int):
    return [Record(step, None, 0, "grad_reduced", f"layers.{p}.weight/{statistic}", step + p + s / 10)
            for p in range(parameters) for s, statistic in enumerate(STATISTICS)]


def main(output_dir: str, parameters: int) -> None:
    logging.getLogger("mindmon").disabled = True
    rule = {"rule_name": "AnomalyNan", "args": {"threshold": 0.0}, "kinds": ["grad_reduced"],
            "statistics": list(STATISTICS)}
    sink = AlertSink(AlertConfig.parse("monitor.alert", {"rules": [rule], "dump": True}), output_dir)
    step = 0
    while True:
        step += 1
        sink.write(step_records(step, parameters))
        sink.flush()
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
