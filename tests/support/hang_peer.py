"""One rank of tests/parallel/test_hang.py's fast tests: mindmon's peer watchdog in a plain process (no MindSpore),
its place in the step set by lines on stdin.

    hang_peer.py RANK WORLD PORT HANG_AFTER OUTPUT_DIR

Stdin lines: `enter STEP PHASE` (mindmon.core.progress.PROGRESS.enter), `close` (the watchdog closes, the
process ends). Prints `ready` once the watchdog runs, `on_hang <number> <odd ranks> <step> <phase>` for
each hang handed to the callback (rank 0 only).
"""
import logging
import sys

from mindmon.core.engine import RunInfo
from mindmon.parallel.watchdog import PeerWatchdog
from mindmon.core.progress import PROGRESS


def on_hang(hang) -> None:
    print(f"on_hang {hang.number} {list(hang.odd)} {hang.majority[0]} {hang.majority[1]}", flush=True)


def main(rank: int, world: int, port: int, hang_after: float, output_dir: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    watchdog = PeerWatchdog(rank, world, ("127.0.0.1", port), logging.getLogger("mindmon"), hang_after=hang_after,
                            output_dir=output_dir, on_hang=on_hang)
    watchdog.start(RunInfo(rank))
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["enter"]:
            PROGRESS.enter(int(words[1]), words[2])
        elif words == ["close"]:
            watchdog.stop()
            return


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
