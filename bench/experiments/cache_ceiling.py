"""The most prompt cache the fleet-cache workload can reuse on llama.cpp (issue 18's 0.8 target):
every conversation on one engine, as perfect affinity would place them, with no gate between.

    python -m bench.experiments.cache_ceiling [--conversations 4] [--systems 2] [--turns 4]

One real engine (xllamacpp with the gemma-3 270M package, 2 slots, `--swa-full`, as
bench/fleet.py starts them) and bench/fleet.py's workload, scaled down to what one engine
serves without a line: the share of prompt tokens llama.cpp reused (`timings.cache_n` over
`cache_n + prompt_n`) is the ceiling for any routing, since no router can place turns better
than all on the engine that ran their conversation.
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
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    workload = Workload(
        systems=args.systems,
        conversations=args.conversations,
        clients=args.conversations,
        turns=args.turns,
    )
    logs = Path(tempfile.mkdtemp(prefix="slotgate-cache-ceiling-"))
    engines = start_engines(logs, 1, 2, 2048, "ceiling", swa_full=True)
    try:
        found = run_loop(measure(engines.urls[0], engines.urls, workload))
    finally:
        engines.stop()
    keys = ("reused", "prompt_tokens_reused", "ttft_p50_ms", "answered", "total_s")
    print(json.dumps({"workload": vars(args)} | {k: found.get(k) for k in keys}))


if __name__ == "__main__":
    main()
