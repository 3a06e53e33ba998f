"""`python -m app` runs slotgate, like the `slotgate` command."""

from app.cli import main

raise SystemExit(main())
