"""The alert sink's cost per step in a storm: a rule firing on every value, N anomalies a step, the
dump on (and optionally an SQLite recipient), printed at the steps asked for. Shows whether a
step's cost grows with the anomalies found so far.

    PYTHONPATH=. python tools/bench_alert_storm.py [--per-step 10000] [--steps 100] [--report 1,10,100]
        [--sqlite]
"""
import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

from mindmon.features.alerts import AlertConfig, AlertSink
from mindmon.core.records import Record

STATISTICS = ("norm", "min", "max", "mean", "zeros", "nans")


def storm_records(step: int, per_step: int):
    parameters = per_step // len(STATISTICS) + 1
    return [Record(step, None, 0, "grad_reduced", f"layers.{p}.weight/{statistic}", 1.0 + p + s / 10)
            for p in range(parameters) for s, statistic in enumerate(STATISTICS)][:per_step]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-step", type=int, default=10000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--report", default="1,10,100", help="steps whose cost is printed")
    parser.add_argument("--sqlite", action="store_true", help="also deliver to an SQLite file")
    args = parser.parse_args(argv)
    wanted = {int(s) for s in args.report.split(",")}
    quiet = logging.getLogger("mindmon")   # the 21 log lines a step are made and handled, not printed
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    with tempfile.TemporaryDirectory() as folder:
        section = {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 0.0}, "kinds": ["grad_reduced"],
                              "statistics": list(STATISTICS)}], "dump": True}
        if args.sqlite:
            section["inform"] = {"connection_str": f"sqlite:///{os.path.join(folder, 'alerts.db')}", "batch_size": 5000}
        sink = AlertSink(AlertConfig.parse("monitor.alert", section), folder)
        costs = {}
        for step in range(1, args.steps + 1):
            records = storm_records(step, args.per_step)   # made outside the timed part
            started = time.perf_counter()
            sink.write(records)
            sink.flush()
            costs[step] = time.perf_counter() - started
            if step in wanted:
                window = [costs[s] for s in range(max(1, step - 2), step + 1)]
                print(f"step {step:>5}: {costs[step] * 1e3:7.1f} ms (median of steps {max(1, step - 2)}-{step}: "
                      f"{statistics.median(window) * 1e3:.1f} ms), dump "
                      f"{os.path.getsize(sink.dump.path) / 1e6:.1f} MB", flush=True)
        sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
