"""The server-side scripts of the shared admission (app/replicas/shared.py): one function library
(Redis 7 or later, any Valkey) made of the `.lua` files beside this module (package data), loaded
by the first call that finds it missing. `common.lua` holds the helpers; each other file is one
function's body. Every call passes POLICY first (the numbers the scripts decide by, written
here once), then its own arguments.

Every function takes one key, the fleet's prefix `slotgate:{<fleet>}:`; the keys it touches are
that prefix and a suffix, so they all hash to one cluster slot. The keys:

- `pools`     hash upstream -> capacity (the slots its /props reports; absent: unknown), then
              TAB and its KV-cache budget in tokens when one binds
- `active`    hash upstream -> slots granted on it
- `tokens`    hash upstream -> tokens the requests granted on it hold of its budget (counted
              only while a budget binds there)
- `line`      sorted set of waiting tickets; score = tag - band * BAND_SPAN (a higher band
              first), members `<seq as 16 hex digits>|<ticket id>`, so that equal scores fall
              back to arrival
- `tickets`   hash member -> the ticket: "replica TAB least TAB cost TAB band TAB tenant TAB
              share TAB max_active TAB charge TAB tasks TAB ranking" (least: the fewest slots it
              runs in; tasks: a prompt array's, 0 for any other request, see `weighs`; ranking:
              upstream ids joined by newlines, best first; max_active -1: none; charge: its
              provisional fair charge)
- `seq`       the arrival counter; `granted` the grant counter (a grant's place, read back)
- `hold`      the moving average of slot hold times, in seconds
- `fair`      hash "v TAB band" -> the band's virtual time, "f TAB band TAB tenant" -> the
              tenant's finish tag, "l TAB band TAB tenant" -> its latest start tag (in
              thousandths of the fleet's average hold x slots per unit of share)
- `tactive`, `tqueued`  hash tenant -> slots it holds, places it has in the line
- `replicas`  sorted set replica -> expiry of its last heartbeat (server time, ms); for one given
              up that still holds grants, the end of their keeping
- `kept`      hash replica -> how long its grants are kept once its heartbeat expired (ms)
- `given_up`  hash replica -> 1: its heartbeat expired, its grants are still counted
- `hb:<r>`    a replica's heartbeat, with a TTL; `r:<r>` hash member -> "w" (waiting) or
              "g TAB upstream TAB tokens TAB slots TAB ticket" (granted): what the replica holds
- `q:<tenant>` hash: a tenant's quota windows (quota.lua): `m` the minute's number, `r` its
              requests, `mt` its tokens, `d` the UTC day's number, `dt` its tokens; it expires
              a minute after its day ends
- channel `ch:<r>`: "member TAB upstream TAB reason TAB grant number TAB slots" per grant handed
  over.

A waiter behind a head that waits may run out of turn, as in one process (`_dispatch` in
app/gate/admission.py states the rule): only on an upstream with fewer slots than the head asks at
least, and than any waiter ahead of it that could use that upstream (`backfill`).

Fair order (start-time fair queuing over slot-seconds, as app/gate/fairline.py in one process): a
ticket of a named tenant gets the tag max(V, F, L) in its band, where V is the band's virtual
time (the latest tag granted), F the tenant's finish tag and L its latest tag (so that its own
tickets stay in arrival order); F then grows by the provisional charge, one average hold x
weight / share. A release corrects F by the hold it really had, in average holds (the fleet's
moving average), minus that one; a waiter that leaves takes its charge back. Counting in
average holds rather than seconds keeps tags given before the average was known (or while it
moved) comparable with later ones. A tenant idle for a while starts at V: it banks no
credit. Without a tenant ("": no API keys) the tag is the arrival number: exact FIFO.
"""

from __future__ import annotations

import hashlib
from importlib import resources

from slotgate.gate.policy import BACKFILL_SCAN as _BACKFILL_SCAN
from slotgate.gate.policy import QueuePolicy

#: A band's span of the score: tags (arrival numbers, or virtual start times in thousandths of
#: an average hold) stay below it, and the score stays an exact integer in a double for bands
#: up to 511.
BAND_SPAN = 2**44
#: Tickets dispatch looks at past heads whose tenant is at its max_active.
SCAN = 32
#: Waiters a backfill looks at behind a head that waits (the core's, app/gate/admission.py).
BACKFILL_SCAN = _BACKFILL_SCAN
#: A fair tag's unit: one average hold is this many.
UNIT = 1000
#: Every call's first arguments, in the order `setup` in common.lua takes them off.
POLICY: tuple[int, ...] = (
    BAND_SPAN, SCAN, BACKFILL_SCAN, UNIT, QueuePolicy.DEFAULT_PER_SLOT, QueuePolicy.DEFAULT_MIN,
)  # fmt: skip

#: The functions, each the body of `<name lowercased>.lua`.
NAMES = (
    "ENTER",
    "RELEASE",
    "HEARTBEAT",
    "REJOIN",
    "RESIZE",
    "RETIRE",
    "REROUTE",
    "REKEY",
    "RETUNE",
    "QUOTA",
)


def _read(name: str) -> str:
    return resources.files(__name__).joinpath(f"{name}.lua").read_text(encoding="utf-8")


_COMMON = _read("common")


def script(body: str) -> str:
    """`body` as a script for EVAL, with the helpers it calls (its arguments without POLICY)."""
    return _COMMON + "setup(KEYS)\n" + body


def _library() -> tuple[str, dict[str, str]]:
    # Named by a hash of its code: replicas of different versions each call their own.
    code = _COMMON + "".join(
        f"redis.register_function('{{lib}}_{name.lower()}', function(KEYS, ARGV)\n"
        f"setup(KEYS, ARGV)\n{_read(name.lower())}end)\n"
        for name in NAMES
    )
    lib = "slotgate_" + hashlib.sha256(code.encode()).hexdigest()[:16]
    functions = {name: f"{lib}_{name.lower()}" for name in NAMES}
    return f"#!lua name={lib}\n" + code.replace("{lib}", lib), functions


#: The scripts as one function library (FUNCTION LOAD): its helpers are made once, when it is
#: loaded, not at every call as an EVAL script's are (about 6 us of each call). LIBRARY's text,
#: FUNCTIONS the name of each script's function in it.
LIBRARY, FUNCTIONS = _library()


def unset(value: int | None) -> int:
    """A limit as the scripts read it: -1 for none."""
    return -1 if value is None else value
