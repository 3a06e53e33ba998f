"""`python -m bench` from the repository root; see bench/README.md."""

from bench.run import main

raise SystemExit(main())
