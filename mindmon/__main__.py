"""`python -m mindmon ...` is the `mindmon` command."""
import sys

from mindmon.cli import main

sys.exit(main())
