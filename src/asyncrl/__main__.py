"""`python -m asyncrl ...` is the same as the `asyncrl` console script."""

from asyncrl.launcher.cli import main

raise SystemExit(main())
