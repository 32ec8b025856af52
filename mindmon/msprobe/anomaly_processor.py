"""`python -m mindmon.msprobe.anomaly_processor -d DIR [-o OUT] [-k 8] [-s STEP_LIST]`: msprobe's anomaly
analyser flags, mindmon's ordering (see mindmon/features/alerts/analyse.py and docs/alerts.md)."""
import argparse
import sys

from mindmon.features.alerts import analyse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mindmon.msprobe.anomaly_processor",
                                     description="Order the dumped anomalies, first in time first, across ranks")
    analyse.add_arguments(parser)
    return analyse.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
