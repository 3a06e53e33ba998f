"""Targets from issue 6 checked against one run's figures, a markdown report and the plots."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from bench.stats import difference, ratio

HIGH = "slotgate-high"
LOW = "slotgate-low"


def _row(results: dict[str, Any], scenario: str, contender: str) -> dict[str, Any]:
    value = results["scenarios"].get(scenario, {}).get(contender)
    return value if isinstance(value, dict) and "error" not in value else {}


def _pick(rows: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """The row at `concurrency`, else the highest concurrency measured below it."""
    if str(concurrency) in rows:
        row: dict[str, Any] = rows[str(concurrency)]
        return row
    below = [int(c) for c in rows if int(c) <= concurrency]
    return rows[str(max(below))] if below else {}


def _target(
    name: str, value: float | None, limit: float, unit: str, at_most: bool
) -> dict[str, Any]:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {
        "target": name,
        "value": value,
        "limit": f"{'<=' if at_most else '>='} {limit:g}{unit}",
        "met": met,
    }


def _at_most(name: str, value: float | None, limit: float, unit: str = "") -> dict[str, Any]:
    return _target(name, value, limit, unit, at_most=True)


def _at_least(name: str, value: float | None, limit: float, unit: str = "") -> dict[str, Any]:
    return _target(name, value, limit, unit, at_most=False)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of issue 6 as {target, value, limit, met}; met is None when not measured."""
    s = results["scenarios"]
    found: list[dict[str, Any]] = []
    one = {name: _row(results, "1_nonstream", name) for name in s.get("1_nonstream", {})}
    if one:
        direct_p50 = _pick(one.get("direct", {}), 1).get("p50_ms")
        found += [
            _at_most(
                f"added p50 latency at c=1, {gate} vs direct (ms)",
                difference(_pick(one.get(gate, {}), 1).get("p50_ms"), direct_p50),
                0.2,
                " ms",
            )
            for gate in (HIGH, LOW)
        ]
        high32 = _pick(one.get(HIGH, {}), 32)
        nginx32 = _pick(one.get("nginx", {}), 32)
        found += [
            _at_least(
                "non-streamed rps at c=32, slotgate-high / nginx",
                ratio(high32.get("rps"), nginx32.get("rps")),
                0.3,
                "x",
            ),
            # Other people's work on a shared core skews req/s; CPU per request much less so.
            _at_least(
                "(CPU-normalised) requests per CPU second at c=32, slotgate-high / nginx",
                ratio(nginx32.get("cpu_s_per_1k"), high32.get("cpu_s_per_1k")),
                0.3,
                "x",
            ),
            _at_least(
                "non-streamed rps at c=32, slotgate-high / LiteLLM",
                ratio(high32.get("rps"), _pick(one.get("litellm", {}), 32).get("rps")),
                10,
                "x",
            ),
        ]
    two = {name: _row(results, "2_stream", name) for name in s.get("2_stream", {})}
    if two:
        direct = two.get("direct", {}).get("latency_c1", {})
        high = two.get(HIGH, {})
        found += [
            _at_most(
                "streaming: added per-chunk latency p50, slotgate-high vs direct",
                difference(
                    high.get("latency_c1", {}).get("chunk_transit_p50_ms"),
                    direct.get("chunk_transit_p50_ms"),
                ),
                0.1,
                " ms",
            ),
            _at_least(
                "streaming: chunks/s, slotgate-high / nginx",
                ratio(
                    high.get("throughput", {}).get("chunks_per_s"),
                    two.get("nginx", {}).get("throughput", {}).get("chunks_per_s"),
                ),
                0.3,
                "x",
            ),
        ]
    storm = s.get("3_storm", {})
    if "closed_loop" in storm:
        found += [
            _at_most(
                f"storm ({loop.replace('_', ' ')}): p99 time to the 429 (ms)",
                storm[loop]["p99_ms"],
                5,
                " ms",
            )
            for loop in ("closed_loop", "open_loop")
        ]
        best = max((row.get("rps") or 0 for row in one.get(HIGH, {}).values()), default=None)
        found.append(
            _at_least(
                "storm: 429s/s / slotgate-high's best non-streamed rps",
                ratio(storm["closed_loop"]["rejections_per_s"], best),
                1,
                "x",
            )
        )
    handoff = s.get("3b_handoff", {}).get("slotgate", {})
    if handoff:
        found += [
            _at_most(
                f"hand-off: idle slot at the upstream, {q} (ms)", handoff[f"idle_{q}_ms"], x, " ms"
            )
            for q, x in (("p50", 0.3), ("p99", 2))
        ]
    memory = s.get("4_memory", {})
    if "kb_per_waiter" in memory:
        found.append(
            _at_most(
                f"memory per waiting request at {memory['waiters']} (KB)",
                memory["kb_per_waiter"],
                10,
                " KB",
            )
        )
    core = s.get("5_core", {})
    if "fast_depth_0" in core:
        depth = core["depth"]
        found += [
            _at_least("core: pairs/s at depth 0 (enter+release)", core["fast_depth_0"], 500_000),
            _at_least(
                f"core: pairs/s at depth {depth} (hand-off)",
                core[f"handoff_depth_{depth}"],
                500_000,
            ),
        ]
        found += [
            _at_least(
                f"core: {kind} pairs/s, depth {depth} / depth 0 (flat)",
                ratio(core[f"{kind}_depth_{depth}"], core[f"{kind}_depth_0"]),
                0.9,
                "x",
            )
            for kind in ("handoff", "churn")
        ]
    llama = s.get("6_llama", {})
    if "ratio" in llama:
        found += [
            _at_least("real llama.cpp: tokens/s, slotgate / direct", llama["ratio"], 0.99, "x"),
            _at_most(
                "real llama.cpp: requests_deferred through slotgate (max)",
                llama["slotgate"]["requests_deferred_max"],
                0,
            ),
        ]
    return found + fleet_targets(s)


AFFINITY = "slotgate-affinity"
LEAST = "slotgate-least-loaded"
NGINX_LC = "nginx-least-conn"


def fleet_targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 18's targets, from the fleet scenarios (bench/fleet.py)."""
    found: list[dict[str, Any]] = []
    cache = s.get("fleet_cache", {})
    runs = {
        name: cache[name]
        for name in (AFFINITY, LEAST, NGINX_LC)
        if isinstance(cache.get(name), dict) and "error" not in cache[name]
    }
    if cache:
        found += [
            _at_least(
                "fleet: prompt tokens reused, slotgate affinity",
                runs.get(AFFINITY, {}).get("reused"),
                0.8,
            ),
            _at_least(
                "fleet: TTFT p50, nginx least_conn / slotgate affinity",
                ratio(
                    runs.get(NGINX_LC, {}).get("ttft_p50_ms"),
                    runs.get(AFFINITY, {}).get("ttft_p50_ms"),
                ),
                2,
                "x",
            ),
        ]
        found += [
            _at_most(
                f"fleet: requests_deferred on any engine through {name} (max)",
                runs.get(name, {}).get("requests_deferred_max"),
                0,
            )
            for name in (AFFINITY, LEAST)
        ]
        for name, run in runs.items():
            idle = run.get("all_idle_after_s")
            row = _at_most(f"fleet: every slot idle after the run, {name} (s)", idle, 1, " s")
            if idle is None and run.get("requests"):
                row.update(value="not within 5 s", met=False)
            found.append(row)
    cost = s.get("fleet_cost", {})
    found += [
        _at_most(
            f"fleet: CPU per request, {cost['upstreams']} upstreams / 1 ({mode}, one offered rate)",
            cost[mode].get("ratio"),
            1.1,
            "x",
        )
        for mode in ("no key", "keyed")
        if isinstance(cost.get(mode), dict)
    ]
    balance = s.get("fleet_balance", {})
    if "max_abs_deviation" in balance:
        found += [
            _at_most(
                "fleet: balance, max |busy share / capacity share - 1|",
                balance["max_abs_deviation"],
                0.1,
            ),
            _at_most(
                "fleet: generations above an upstream's slots (stand-ins)",
                balance["above_slots"],
                0,
            ),
        ]
    return found


# -- markdown --


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows]
    return [*lines, ""]


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    s = results["scenarios"]
    out = [
        "# slotgate benchmark",
        "",
        f"Run {meta['started']} with `{meta['command']}`, {meta['duration_s']:.0f} s in all. "
        f"{meta['machine']}. slotgate at {meta.get('slotgate_tree', '?')}. "
        f"Servers pinned to core {meta['server_core']}, load generator and "
        f"stand-in upstream on core {meta['client_core']} (pinned: {meta['pinned']}). "
        + ("Cores kept awake (`--cores-awake`). " if meta.get("cores_awake") else "")
        + "CPU used by processes outside the bench during the run: "
        f"{meta.get('foreign_cpu_share', '-')} of the machine.",
        "",
    ]
    out += [f"- {note}" for note in meta["notes"]]
    out.append("")
    out += ["## Targets", ""]
    out += _table(
        ["target", "value", "limit", "met"],
        [[t["target"], t["value"], t["limit"], t["met"]] for t in results["targets"]],
    )
    one = s.get("1_nonstream", {})
    if one:
        out += ["## 1. Non-streamed chat completions", ""]
        nginx = one.get("nginx", {})
        direct = one.get("direct", {})
        rows = []
        for name, by_c in one.items():
            if "error" in by_c:
                rows.append([name, "-", by_c["error"], "", "", "", "", "", "", ""])
                continue
            for c, row in by_c.items():
                rows.append(
                    [
                        name,
                        int(c),
                        row["rps"],
                        row["p50_ms"],
                        row["p99_ms"],
                        difference(row["p50_ms"], direct.get(c, {}).get("p50_ms")),
                        row["cpu_s_per_1k"],
                        row["server_core_util"],
                        ratio(row["rps"], nginx.get(c, {}).get("rps")),
                        ratio(nginx.get(c, {}).get("cpu_s_per_1k"), row["cpu_s_per_1k"]),
                    ]
                )
        out += _table(
            [
                "contender",
                "c",
                "req/s",
                "p50 ms",
                "p99 ms",
                "added p50 ms",
                "CPU s / 1k req",
                "server core use",
                "x nginx req/s",
                "x nginx req per CPU s",
            ],
            rows,
        )
    two = s.get("2_stream", {})
    if two:
        out += ["## 2. Streamed chat completions (64 tokens)", ""]
        direct = two.get("direct", {}).get("latency_c1", {})
        nginx_t = two.get("nginx", {}).get("throughput", {}).get("chunks_per_s")
        rows = []
        for name, row in two.items():
            if "error" in row:
                rows.append([name, row["error"], "", "", "", "", "", "", "", ""])
                continue
            lat, thr = row["latency_c1"], row["throughput"]
            rows.append(
                [
                    name,
                    lat["chunk_transit_p50_ms"],
                    difference(lat["chunk_transit_p50_ms"], direct.get("chunk_transit_p50_ms")),
                    lat["chunk_transit_p99_ms"],
                    lat["inter_chunk_gap_p99_ms"],
                    lat["ttft_p50_ms"],
                    difference(lat["ttft_p50_ms"], direct.get("ttft_p50_ms")),
                    thr["chunks_per_s"],
                    ratio(thr["chunks_per_s"], nginx_t),
                    thr["cpu_s_per_1k_chunks"],
                    thr["server_core_util"],
                ]
            )
        out += _table(
            [
                "contender",
                "chunk latency p50 ms (c=1)",
                "added p50 ms",
                "chunk latency p99 ms",
                "gap p99 ms",
                "TTFT p50 ms",
                "added TTFT ms",
                "chunks/s (c=64)",
                "x nginx",
                "CPU s / 1k chunks",
                "server core use",
            ],
            rows,
        )
    out += _fleet_markdown(s)
    for key, title in (
        ("3_storm", "3. Storm"),
        ("3b_handoff", "3b. Hand-off"),
        ("4_memory", "4. Memory"),
        ("5_core", "5. Admission core alone"),
        ("6_llama", "6. Real llama.cpp"),
        ("burst", "Burst (plot)"),
    ):
        if key in s:
            out += [f"## {title}", ""]
            out += _table(["figure", "value"], list(_flatten(s[key])))
    return "\n".join(out) + "\n"


def _fleet_markdown(s: dict[str, Any]) -> list[str]:
    out: list[str] = []
    cache = s.get("fleet_cache", {})
    if cache:
        out += [
            "## Fleet: multi-turn workload on real llama.cpp engines",
            "",
            f"{cache.get('engines')} engines x {cache.get('slots_per_engine')} slots "
            f"({cache.get('ctx_per_slot')} tokens each), {cache.get('systems')} system prompts, "
            f"{cache.get('conversations')} conversations x {cache.get('turns')} turns, "
            f"max_tokens {cache.get('max_tokens')}, at most {cache.get('clients')} at once, "
            f"one started every {cache.get('stagger_s')} s, think time "
            f"{cache.get('think_s')} s x [0.5, 1.5] between turns; "
            f"engines restarted before each contender; --swa-full: {cache.get('swa_full')}.",
            "",
        ]
        rows = []
        for name, run in cache.items():
            if not isinstance(run, dict):
                continue
            if "error" in run:
                rows.append([name, _one_line(run["error"]), "", "", "", "", "", "", "", ""])
                continue
            routed = run.get("routed")
            rows.append(
                [
                    name,
                    run["reused"],
                    run["ttft_p50_ms"],
                    run["ttft_p95_ms"],
                    run["total_s"],
                    f"{run['requests'] - run['failed']}/{run['expected']}",
                    run["requests_deferred_max"],
                    run["all_idle_after_s"],
                    run["first_turn_prompt_tokens_mean"],
                    " / ".join(f"{_fmt(routed.get(k, 0))}" for k in ("affinity", "load", "retry"))
                    if routed
                    else "-",
                ]
            )
        out += _table(
            [
                "contender",
                "prompt tokens reused",
                "TTFT p50 ms",
                "TTFT p95 ms",
                "total s",
                "answered",
                "requests_deferred max",
                "all slots idle after s",
                "turn-1 prompt tokens",
                "routed by affinity / load / retry",
            ],
            rows,
        )
    cost = s.get("fleet_cost", {})
    if cost:
        out += ["## Fleet: routing cost (stand-ins)", ""]
        if "error" in cost:
            out += [_one_line(cost["error"]), ""]
        many = str(cost.get("upstreams"))
        rows = []
        for mode in ("no key", "keyed"):
            row = cost.get(mode)
            if isinstance(row, dict):
                per = row["cpu_ms_per_request"]
                full = row.get("saturated", {})
                full_per = full.get("cpu_ms_per_request", {})
                rates = row.get("offered_rate_per_s") or []
                rows.append(
                    [mode, row["routing"], ", ".join(f"{rate:,}" for rate in rates),
                     per.get("1"), per.get(many), row["ratio"],
                     f"{full_per.get('1')} / {full_per.get(many)}", full.get("ratio"),
                     row["requests"].get("1"), row["requests"].get(many)]
                )  # fmt: skip
        if rows:
            out += [
                "CPU per request at one offered rate (an open loop at 0.7 of the slower gate's "
                "saturated rate, per round; the target's figure), and saturated (a closed loop "
                f"of {cost.get('clients')} clients).",
                "",
            ]
            out += _table(
                [
                    "affinity key",
                    "ROUTING",
                    "offered req/s",
                    "CPU ms / request, 1 upstream",
                    f"CPU ms / request, {many} upstreams",
                    "ratio",
                    f"saturated: CPU ms / request, 1 / {many}",
                    "saturated ratio",
                    "requests (1)",
                    f"requests ({many})",
                ],
                rows,
            )
    balance = s.get("fleet_balance", {})
    if balance:
        out += ["## Fleet: balance (stand-ins, no affinity key)", ""]
        if "error" in balance:
            out += [_one_line(balance["error"]), ""]
        else:
            out += [
                f"Open loop at {balance['offered_load']:.0%} of the capacity "
                f"({balance['offered_per_s']} requests/s, {balance['generation_s'] * 1000:g} ms "
                f"generations), ROUTING={balance['routing']}; utilisation measured "
                f"{balance['utilisation']:.0%}.",
                "",
            ]
            out += _table(
                ["slots", "capacity share", "busy share", "deviation", "generations", "peak"],
                [
                    [r["slots"], r["capacity_share"], r["busy_share"], r["deviation"],
                     r["generations"], r["peak_running"]]
                    for r in balance["upstreams"]
                ],
            )  # fmt: skip
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _flatten(value: dict[str, Any], prefix: str = "") -> Any:
    for key, item in value.items():
        if key in ("samples", "requests_deferred_samples"):
            continue
        if isinstance(item, dict):
            yield from _flatten(item, f"{prefix}{key}.")
        else:
            yield [f"{prefix}{key}", item]


def console(results: dict[str, Any]) -> str:
    """The markdown's tables, for the terminal."""
    return markdown(results)


# -- plots --


def plots(results: dict[str, Any], out: Path) -> list[str]:
    if importlib.util.find_spec("matplotlib") is None:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    one = {k: v for k, v in results["scenarios"].get("1_nonstream", {}).items() if "error" not in v}
    if one:
        figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        for name, rows in one.items():
            cs = [int(c) for c in rows]
            (line,) = left.plot(
                cs, [rows[str(c)]["p50_ms"] for c in cs], marker="o", label=f"{name} p50"
            )
            left.plot(
                cs,
                [rows[str(c)]["p99_ms"] for c in cs],
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{name} p99",
            )
            right.plot(cs, [rows[str(c)]["rps"] for c in cs], marker="o", label=name)
        for axis in (left, right):
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("concurrent clients")
            axis.grid(True, which="both", alpha=0.3)
        left.set_ylabel("latency (ms)")
        left.set_title("Non-streamed latency vs concurrency (one core each)")
        left.legend(fontsize=7, ncol=2)
        right.set_ylabel("requests/s")
        right.set_title("Non-streamed throughput vs concurrency")
        right.legend(fontsize=8)
        figure.tight_layout()
        path = out / "latency_vs_concurrency.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path.name)
    burst = results["scenarios"].get("burst", {})
    if burst.get("samples"):
        samples = burst["samples"]
        t = [sample["t_s"] for sample in samples]
        figure, axis = plt.subplots(figsize=(10, 4.5))
        axis.plot(t, [sample["queued"] for sample in samples], label="queued (line depth)")
        axis.plot(t, [sample["done"] for sample in samples], color="gray", linestyle=":",
                  label="answered")  # fmt: skip
        axis.set_xlabel("seconds")
        axis.set_ylabel("requests")
        # Active slots live on their own scale: a handful against hundreds in line.
        other = axis.twinx()
        other.plot(t, [sample["active"] for sample in samples], color="tab:orange",
                   label="active slots (right axis)")  # fmt: skip
        other.set_ylabel("active slots")
        other.set_ylim(0, burst["slots"] + 1)
        axis.set_title(
            f"Burst of {burst['clients']} requests on {burst['slots']} slots "
            f"({burst['generation_s'] * 1000:.0f} ms each), from slotgate's /admission"
        )
        lines = axis.get_legend_handles_labels()
        extra = other.get_legend_handles_labels()
        axis.legend(lines[0] + extra[0], lines[1] + extra[1], loc="center right")
        axis.grid(True, alpha=0.3)
        figure.tight_layout()
        path = out / "burst_queue.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path.name)
    return written
