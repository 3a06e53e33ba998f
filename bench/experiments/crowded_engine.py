"""What llama.cpp reuses of the fleet-cache workload when conversations outnumber an engine's
slots, with no gate and no other engine: every conversation on one engine, as a router that
kept each on its first engine would place them once that engine is crowded.

    python -m bench.experiments.crowded_engine [--conversations 4] [--systems 2] [--turns 5]

One real engine (xllamacpp with the gemma-3 270M package, 2 slots, `--swa-full`, as
bench/fleet.py starts them) and bench/fleet.py's workload scaled down: 4 conversations at once
over its 2 slots, so that turns of different conversations take turns on each slot and
llama.cpp swaps their caches through its host-memory prompt cache. It prints the share of
prompt tokens reused (`timings.cache_n` over `cache_n + prompt_n`). Measured at e94f956 and
488b9ef: 0.75 (4 turns of 16 tokens), 0.77 (8 of 16), 0.63 (5 of 64): below what the fleet
reaches when each conversation keeps a slot (0.81-0.86 with affinity, bench/README.md), which
is why a saturated fleet reuses less whatever routes it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.fleet import Workload, measure, start_engines
from bench.loop import run_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--systems", type=int, default=2)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    workload = Workload(
        systems=args.systems,
        conversations=args.conversations,
        clients=args.conversations,
        turns=args.turns,
    )
    logs = Path(tempfile.mkdtemp(prefix="slotgate-crowded-engine-"))
    engines = start_engines(logs, 1, 2, 2048, "crowded", swa_full=True)
    try:
        found = run_loop(measure(engines.urls[0], engines.urls, workload))
    finally:
        engines.stop()
    keys = ("reused", "prompt_tokens_reused", "ttft_p50_ms", "answered", "total_s")
    print(json.dumps({"workload": vars(args)} | {k: found.get(k) for k in keys}))


if __name__ == "__main__":
    main()
