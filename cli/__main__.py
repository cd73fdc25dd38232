"""`python -m k4.cli` runs the k4 app (same as the `k4` console script)."""

from k4.cli.app import main

main()
