"""`python -m moezoo ...`: the `moezoo` command, as launchers that start modules want it (`torchrun -m moezoo train
...`, `accelerate launch -m moezoo train ...`)."""

from .cli import main

raise SystemExit(main())
