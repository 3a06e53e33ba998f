"""`python -m slotgate` runs slotgate, like the `slotgate` command."""

from slotgate.cli import main

raise SystemExit(main())
