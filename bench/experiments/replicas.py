"""What REDIS_URL costs a request through the whole gate (issue 20, part 6), over real sockets:
slotgate processes in front of the stand-in, with and without a valkey-server.

    python -m bench.experiments.replicas [--seconds 5] [--rounds 3]

- **Free path, c=1.** One client, one request at a time, through slotgate alone and through a
  slotgate sharing its line through Valkey; the rounds alternate so that drift in the machine's
  load falls on both alike. The difference of the latency quantiles is what the shared line
  adds to a request that finds a free slot.
- **Hand-off.** One slot, two clients sending back to back. Through one slotgate alone the
  release hands the slot to the other client's waiting request inside that process; through
  two replicas (one client on each) every release is handed to a waiter on the other replica,
  through Valkey. The stand-in records how long each freed slot stays empty until the next
  request reaches it (`record_gaps`): that is the hand-off, end to end.
- Valkey's own time per script call (`INFO commandstats`) over the runs.

Servers on the server core, the client, the stand-in and Valkey on the other (bench/procs.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.contenders import configure_standin, standin_stats, start_slotgate, start_standin
from bench.loadgen import chat_body, closed_loop, request_bytes
from bench.procs import CLIENT_CORE, SERVER_CORE, Server
from tests.support.valkey import Valkey, server_binary

CHAT = "/v1/chat/completions"


def quantiles_ms(samples_ns: list[int]) -> tuple[float, float]:
    cuts = statistics.quantiles(samples_ns, n=100, method="inclusive")
    return cuts[49] / 1e6, cuts[98] / 1e6


async def latency(server: Server, seconds: float) -> list[int]:
    raw = request_bytes(server.port, CHAT, chat_body(stream=False, max_tokens=1))
    result = await closed_loop(server.port, raw, 1, seconds, warmup_s=0.5)
    assert set(result.statuses) == {200}, result.statuses
    return result.latencies_ns


async def gaps(standin: Server, servers: list[Server], seconds: float) -> list[int]:
    """Two clients over one slot, client i through servers[i % len(servers)]."""
    configure_standin(standin, slots=1, tokens=4, token_delay_s=0.002, record_gaps=True)
    await asyncio.sleep(0.5)  # every slotgate reads the one slot (PROPS_REFRESH_INTERVAL_S)
    raw = [request_bytes(s.port, CHAT, chat_body(stream=False, max_tokens=4)) for s in servers]
    await asyncio.gather(
        *(closed_loop(servers[i % len(servers)].port, raw[i % len(raw)], 1, seconds)
          for i in range(2))
    )  # fmt: skip
    stats = standin_stats(standin)
    configure_standin(standin, slots=64, tokens=1, token_delay_s=0.0, record_gaps=False)
    found = stats["gaps_ns"]
    assert isinstance(found, list)
    return [int(gap) for gap in found]


def script_stats(valkey: Valkey) -> str:
    """Valkey's own count and time of the script calls (EVALSHA; EVAL once per script)."""
    out = subprocess.run(
        [str(server_binary().with_name("valkey-cli")), "-p", str(valkey.port),
         "INFO", "commandstats"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return "\n".join(line for line in out.stdout.splitlines() if "cmdstat_eval" in line)


def start_valkey() -> Valkey:
    """Valkey beside the client and the stand-in, off the slotgates' core."""
    valkey = Valkey()
    valkey.start()
    assert valkey.process is not None
    subprocess.run(
        ["taskset", "-pc", str(CLIENT_CORE), str(valkey.process.pid)],
        capture_output=True, check=False,
    )  # fmt: skip
    return valkey


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cores", choices=("one", "apart", "free"), default="one",
        help="the replicas both on the server core, the second on the client's, or unpinned",
    )  # fmt: skip
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="slotgate-replicas-"))
    valkey = start_valkey()
    standin = start_standin(logs)
    configure_standin(standin, slots=64, tokens=1, token_delay_s=0.0, stamps=False)
    url = f"http://127.0.0.1:{standin.port}"
    fast = {"PROPS_REFRESH_INTERVAL_S": "0.2", "KEEPALIVE_INTERVAL_S": "0"}
    shared = {**fast, "REDIS_URL": valkey.url, "REDIS_FLEET": "bench"}
    alone = start_slotgate("slotgate-alone", url, logs, fast)
    cores = {"one": (SERVER_CORE, SERVER_CORE), "apart": (SERVER_CORE, CLIENT_CORE),
             "free": (None, None)}[args.cores]  # fmt: skip
    first = start_slotgate("slotgate-shared-a", url, logs, shared, core=cores[0])
    second = start_slotgate("slotgate-shared-b", url, logs, shared, core=cores[1])
    try:
        local_ns: list[int] = []
        redis_ns: list[int] = []
        for _ in range(args.rounds):
            local_ns += await latency(alone, args.seconds)
            redis_ns += await latency(first, args.seconds)
        lp50, lp99 = quantiles_ms(local_ns)
        rp50, rp99 = quantiles_ms(redis_ns)
        print(f"free path, c=1: alone p50 {lp50:.3f} ms p99 {lp99:.3f} ms ({len(local_ns)})")
        print(f"free path, c=1: shared p50 {rp50:.3f} ms p99 {rp99:.3f} ms ({len(redis_ns)})")
        print(f"free path, c=1: added p50 {rp50 - lp50:+.3f} ms p99 {rp99 - lp99:+.3f} ms")
        local_gaps: list[int] = []
        redis_gaps: list[int] = []
        for _ in range(args.rounds):
            local_gaps += await gaps(standin, [alone], args.seconds)
            redis_gaps += await gaps(standin, [first, second], args.seconds)
        lp50, lp99 = quantiles_ms(local_gaps)
        rp50, rp99 = quantiles_ms(redis_gaps)
        print(f"hand-off: in one slotgate p50 {lp50:.3f} ms p99 {lp99:.3f} ms ({len(local_gaps)})")
        print(f"hand-off: across replicas p50 {rp50:.3f} ms p99 {rp99:.3f} ms ({len(redis_gaps)})")
        print(script_stats(valkey))
    finally:
        for server in (alone, first, second, standin):
            server.stop()
        valkey.kill()


if __name__ == "__main__":
    asyncio.run(main())
