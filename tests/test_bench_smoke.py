"""The benchmark still runs end to end: tiny sizes, only the contenders that need no install.

No timing is asserted here (the bench is not a test); only that every scenario ran, traffic
flowed where it should, and the results file has the shape the report and the plots read.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.awake import cores_awake
from bench.procs import pinning_possible

pytestmark = pytest.mark.bench

REPO = Path(__file__).resolve().parent.parent
CONTENDERS = {"direct", "slotgate-high", "slotgate-low"}
#: Run in scenario 1 only: bench/floor.py's uvicorn relaying to the stand-in.
FLOORS = {"uvicorn-relay"}
SCENARIOS = {"1_nonstream", "2_stream", "3_storm", "3b_handoff", "4_memory", "5_core", "burst"}


def _errors(value: Any, where: str = "") -> list[str]:
    """Every step the bench recorded as failed, with its place in the results."""
    if isinstance(value, dict):
        found = [f"{where}: {value['error']}"] if "error" in value else []
        for key, item in value.items():
            found += _errors(item, f"{where}/{key}")
        return found
    return []


def test_bench_smoke_run_writes_every_scenario_and_target(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "bench", "--smoke", "--no-install",
        "--contenders", ",".join(sorted(CONTENDERS | FLOORS)),
        "--scenarios", "1,2,3,3b,4,5,burst",
        "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    results = json.loads((tmp_path / "latest.json").read_text())
    assert {"meta", "scenarios", "targets", "plots"} <= set(results)
    scenarios = results["scenarios"]
    assert set(scenarios) == SCENARIOS
    assert _errors(scenarios) == []

    for contender in CONTENDERS:
        rows = scenarios["1_nonstream"][contender]
        assert set(rows) == {"1", "4"}
        for row in rows.values():
            assert {"rps", "p50_ms", "p99_ms", "cpu_s_per_1k", "server_core_util"} <= set(row)
            assert row["requests"] > 0
            assert row["failures"] == 0
        streamed = scenarios["2_stream"][contender]
        assert streamed["latency_c1"]["tokens"] > 0
        assert streamed["latency_c1"]["chunk_transit_p50_ms"] is not None
        assert streamed["throughput"]["chunks_per_s"] > 0

    for floor in FLOORS:
        assert floor not in scenarios["2_stream"]
        for row in scenarios["1_nonstream"][floor].values():
            assert row["requests"] > 0
            assert row["failures"] == 0

    storm = scenarios["3_storm"]
    assert set(storm["closed_loop"]["statuses"]) == {"429"}
    assert storm["open_loop"]["statuses"]["429"] > 0
    handoff = scenarios["3b_handoff"]
    assert handoff["slotgate"]["handoffs"] > 0
    assert handoff["direct_2_clients"]["handoffs"] > 0
    if pinning_possible():
        assert handoff["direct_2_clients_across_cores"]["handoffs"] > 0
        assert set(handoff["slotgate_over_across_cores_ms"]) == {"p50", "p99"}
    assert scenarios["4_memory"]["waiters"] == 200
    assert "kb_per_waiter" in scenarios["4_memory"]
    core = scenarios["5_core"]
    assert {"fast_depth_0", "handoff_depth_1000", "churn_depth_1000"} <= set(core)
    assert scenarios["burst"]["max_queued"] > 0
    assert scenarios["burst"]["samples"]

    assert results["targets"]
    for target in results["targets"]:
        assert set(target) == {"target", "value", "limit", "met"}
    assert (tmp_path / "latest.md").read_text().startswith("# slotgate benchmark")
    if importlib.util.find_spec("matplotlib") is not None:
        assert set(results["plots"]) == {"latency_vs_concurrency.png", "burst_queue.png"}
        for name in results["plots"]:
            assert (tmp_path / name).stat().st_size > 0


EXPERIMENTS = (
    "sdk_burst",
    "upstream_memory",
    "slow_heads",
    "big_bodies",
    "tenants_ttft",
    "retry_estimates",
    "request_calls",
)


def _experiment(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", *args]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_explains_its_command_line(name: str) -> None:
    done = _experiment(f"bench.experiments.{name}", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: ")
    assert "--pythonpath" in done.stdout


def test_upstream_memory_experiment_sees_a_huge_upstream_head_refused() -> None:
    done = _experiment(
        "bench.experiments.upstream_memory", "--answer", "huge_head", "--requests", "1"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "after request 1 (status 502," in done.stdout


def test_sdk_burst_experiment_counts_a_burst_that_fits_as_all_succeeded() -> None:
    done = _experiment(
        "bench.experiments.sdk_burst", "--sdk", "openai", "--burst", "2", "--max-tokens", "2"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "openai: 2/2 succeeded" in done.stdout


FLEET_CONTENDERS = ("slotgate-affinity", "slotgate-least-loaded", "nginx-least-conn")


@pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None, reason="the real engines need xllamacpp"
)
def test_fleet_smoke_run_measures_cache_reuse_routing_cost_and_balance(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "bench.fleet",
        "--smoke",
        "--no-install",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "latest.json").read_text())
    scenarios = results["scenarios"]
    assert set(scenarios) == {"fleet_cache", "fleet_cost", "fleet_balance"}
    assert _errors(scenarios) == []

    cache = scenarios["fleet_cache"]
    ran = [name for name in FLEET_CONTENDERS if name in cache]
    assert ran[:2] == ["slotgate-affinity", "slotgate-least-loaded"]
    for name in ran:
        run = cache[name]
        assert run["requests"] == run["expected"] == 4
        assert run["failed"] == 0
        assert run["prompt_tokens"] >= run["prompt_tokens_reused"] >= 0
        assert run["all_idle_after_s"] is not None
        assert len(run["requests_deferred_max_per_engine"]) == 3
    for name in ("slotgate-affinity", "slotgate-least-loaded"):
        assert cache[name]["requests_deferred_max"] == 0
    # One conversation at a time: affinity sends every turn to its key's engine. (How much of
    # the prompt that engine then reuses is llama.cpp's choice of slot: one run in two here,
    # one conversation's second turn found its slot taken by the other's first and reused 0.)
    assert cache["slotgate-affinity"]["routed"] == {"affinity": 4, "load": 0, "retry": 0}

    cost = scenarios["fleet_cost"]
    for mode in ("no key", "keyed"):
        assert cost[mode]["requests"]["1"] > 0
        assert cost[mode]["requests"]["8"] > 0
        assert cost[mode]["failures"] == {"1": 0, "8": 0}
        assert cost[mode]["ratio"] is not None
        # Both gates at one offered rate per round, and saturated beside it.
        assert len(cost[mode]["offered_rate_per_s"]) == cost["rounds"]
        assert all(rate > 0 for rate in cost[mode]["offered_rate_per_s"])
        assert cost[mode]["saturated"]["ratio"] is not None

    balance = scenarios["fleet_balance"]
    assert [row["slots"] for row in balance["upstreams"]] == [1, 2, 4]
    assert balance["statuses"] == {"200": balance["requests"]}
    assert balance["above_slots"] == 0
    assert sum(row["generations"] for row in balance["upstreams"]) > 0

    names = {target["target"] for target in results["targets"]}
    assert "fleet: prompt tokens reused, slotgate affinity" in names
    assert "fleet: balance, max |busy share / capacity share - 1|" in names
    assert "## Fleet: routing cost (stand-ins)" in (tmp_path / "latest.md").read_text()


def test_cores_awake_spins_an_idle_class_process_on_each_core_and_stops_them() -> None:
    cores = sorted(os.sched_getaffinity(0))
    with cores_awake(cores) as pids:
        assert len(pids) == len(cores)
        for pid, core in zip(pids, cores, strict=True):
            # Each sets its own class and core as it starts.
            deadline = time.monotonic() + 30
            while os.sched_getscheduler(pid) != os.SCHED_IDLE:
                assert time.monotonic() < deadline, f"spinner {pid} never took the idle class"
                time.sleep(0.05)
            assert os.sched_getaffinity(pid) == {core}
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
