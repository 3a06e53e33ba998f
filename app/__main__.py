"""`python -m slotgate` runs slotgate, like the `slotgate` command."""

from .cli import main

raise SystemExit(main())
