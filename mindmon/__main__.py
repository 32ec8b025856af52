"""`python -m mindmon ...` is the `mindmon` command."""
import sys

from .cli import main

sys.exit(main())
