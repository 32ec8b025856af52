"""One msrun worker of `mindmon demo --workers N` (started by mindmon/demo/launch.py)."""
import sys

from mindmon.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
