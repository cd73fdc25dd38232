"""`python -m cli` runs the k4 app (same as the `k4` console script)."""

from cli.app import main

main()
