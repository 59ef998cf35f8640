"""`python -m qerl_lib ...` is the same as the `qerl` console script."""
from qerl_lib.cli import main

raise SystemExit(main())
