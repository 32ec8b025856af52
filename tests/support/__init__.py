"""What the tests share: workers (run as scripts, by python or msrun, from this folder), references,
real servers and helpers. A worker run as a script puts the repository on sys.path itself, so
`tests.support` imports the same way there as under pytest."""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
