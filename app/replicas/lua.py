"""The server-side scripts of the shared admission (app/replicas/shared.py), in Lua: one function
library (Redis 7 or later, any Valkey), loaded by the first call that finds it missing.

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

from slotgate.gate.admission import BACKFILL_SCAN as _BACKFILL_SCAN

#: A band's span of the score: tags (arrival numbers, or virtual start times in thousandths of
#: an average hold) stay below it, and the score stays an exact integer in a double for bands
#: up to 511.
BAND_SPAN = 2**44
#: Tickets dispatch looks at past heads whose tenant is at its max_active.
SCAN = 32
#: Waiters a backfill looks at behind a head that waits (the core's, app/gate/admission.py).
BACKFILL_SCAN = _BACKFILL_SCAN

_COMMON = r"""
local P, K_POOLS, K_ACTIVE, K_LINE, K_TICKETS, K_SEQ, K_GRANTED, K_HOLD, K_REPLICAS
local K_TOKENS, K_FAIR, K_TACTIVE, K_TQUEUED, K_KEPT, K_GIVEN_UP
-- The pools, read once per call and kept in step by `take` and `give_back` (see `pools`).
local PL = nil

-- Each call: the fleet's keys (the call's one key is their prefix), the pools unread.
local function setup(keys)
  PL = nil
  if P == keys[1] then return end
  P = keys[1]
  K_POOLS, K_ACTIVE, K_LINE, K_TICKETS = P..'pools', P..'active', P..'line', P..'tickets'
  K_SEQ, K_GRANTED, K_HOLD, K_REPLICAS = P..'seq', P..'granted', P..'hold', P..'replicas'
  K_TOKENS, K_FAIR, K_TACTIVE, K_TQUEUED = P..'tokens', P..'fair', P..'tactive', P..'tqueued'
  K_KEPT, K_GIVEN_UP = P..'kept', P..'given_up'
end
local BAND_SPAN = 17592186044416
local SCAN = 32
local BACKFILL_SCAN = @BACKFILL_SCAN@
local UNIT = 1000
local TWO16, TWO32 = 65536, 4294967296
local function held_key(r) return P..'r:'..r end
local function hb_key(r) return P..'hb:'..r end
local function num(x) return string.format('%.17g', x) end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- splitmix64's finaliser of (key xor salt), as app/gate/routing.py's `score`, exact in doubles: a
-- 64-bit number is two 32-bit halves, products are taken in 16-bit limbs.
local function xor32(a, b) return bit.bxor(a, b) % TWO32 end
local function shr64(hi, lo, s)
  return bit.rshift(hi, s) % TWO32, bit.bor(bit.rshift(lo, s), bit.lshift(hi, 32 - s)) % TWO32
end
local function mul64(ah, al, bh, bl)
  local a0, a1, a2, a3 = al % TWO16, math.floor(al / TWO16), ah % TWO16, math.floor(ah / TWO16)
  local b0, b1, b2, b3 = bl % TWO16, math.floor(bl / TWO16), bh % TWO16, math.floor(bh / TWO16)
  local r0 = a0 * b0
  local r1 = a1 * b0 + a0 * b1 + math.floor(r0 / TWO16)
  local r2 = a2 * b0 + a1 * b1 + a0 * b2 + math.floor(r1 / TWO16)
  local r3 = a3 * b0 + a2 * b1 + a1 * b2 + a0 * b3 + math.floor(r2 / TWO16)
  return (r3 % TWO16) * TWO16 + r2 % TWO16, (r1 % TWO16) * TWO16 + r0 % TWO16
end
local function mix(hi, lo, s)
  local sh, sl = shr64(hi, lo, s)
  return xor32(hi, sh), xor32(lo, sl)
end
local function score64(key, salt_hi, salt_lo)
  local hi = xor32(math.floor(key / TWO32), salt_hi)
  local lo = xor32(key % TWO32, salt_lo)
  hi, lo = mix(hi, lo, 30)
  hi, lo = mul64(hi, lo, 3210233709, 484763065)
  hi, lo = mix(hi, lo, 27)
  hi, lo = mul64(hi, lo, 2496678331, 321982955)
  return mix(hi, lo, 31)
end

-- The pools: capacities, grants, budgets and tokens, their names in order, and the sums over
-- the known ones.
local function pools()
  if PL then return PL end
  local pl = {cap = {}, act = {}, bud = {}, tok = {}, names = {}, fleet_cap = 0,
              fleet_active = 0, max_cap = 0}
  local budgets = false
  local raw = redis.call('HGETALL', K_POOLS)
  for i = 1, #raw, 2 do
    local c, b = string.match(raw[i + 1], '^(%d+)\t?(%d*)$')
    c = tonumber(c)
    if b ~= '' then
      pl.bud[raw[i]] = tonumber(b)
      budgets = true
    end
    pl.cap[raw[i]] = c
    pl.names[#pl.names + 1] = raw[i]
    pl.fleet_cap = pl.fleet_cap + c
    if c > pl.max_cap then pl.max_cap = c end
  end
  if #pl.names > 1 then table.sort(pl.names) end
  raw = redis.call('HGETALL', K_ACTIVE)
  for i = 1, #raw, 2 do
    local a = tonumber(raw[i + 1])
    pl.act[raw[i]] = a
    if pl.cap[raw[i]] then pl.fleet_active = pl.fleet_active + a end
  end
  if budgets then
    raw = redis.call('HGETALL', K_TOKENS)
    for i = 1, #raw, 2 do pl.tok[raw[i]] = tonumber(raw[i + 1]) end
  end
  PL = pl
  return pl
end

-- The tokens of `u`'s budget a request of `cost` takes: its cost, cut to the budget (none
-- where no budget binds).
local function charge_tokens(pl, u, cost)
  local b = pl.bud[u]
  if not b then return 0 end
  if cost > b then return b end
  return cost
end

-- Room on `u` for `w` slots and `cost` tokens (as Pool.fits): the tokens always fit when
-- nothing holds any there or when no budget binds.
local function fits(pl, u, w, cost)
  local c = pl.cap[u]
  if not c or (pl.act[u] or 0) + w > c then return false end
  local b = pl.bud[u]
  if not b then return true end
  local t = pl.tok[u] or 0
  return t <= 0 or t + charge_tokens(pl, u, cost) <= b
end

-- The slots `t` holds on an upstream of `c` slots (as Ticket.weighs): its least, or for a
-- prompt array as many as it has tasks, up to `c` (its least at least).
local function weighs(t, c)
  if t.tasks == 0 then return t.w end
  return math.max(t.w, math.min(t.tasks, c))
end

-- The upstream for ticket `t`, as app/gate/routing.py's `choose`: with a ranking and more than one
-- upstream known, its first with room within the bounded load (active + w <= ceil((fleet_active
-- + w) * (1 + eps) / fleet_cap * cap), w its slots on the largest upstream); else one free
-- slot of the fleet drawn evenly by hashing `seq` over the upstreams with room (in the order of
-- their ids). With `below`, only among the upstreams with a free slot and fewer slots than
-- that (a backfill's). The reason is 'affinity' for the ranking's first (or the only
-- upstream), else 'load'; nil and why not ('unknown', 'large', 'busy') when none has room.
local function choose(t, eps, seq, below)
  local pl = pools()
  if pl.fleet_cap == 0 then return nil, 'unknown' end
  if t.w > pl.max_cap then return nil, 'large' end
  local names, fleet_cap, fleet_active = pl.names, pl.fleet_cap, pl.fleet_active
  if below then
    names, fleet_cap, fleet_active = {}, 0, 0
    for _, u in ipairs(pl.names) do
      local c, a = pl.cap[u], pl.act[u] or 0
      if a < c and c < below then
        names[#names + 1] = u
        fleet_cap, fleet_active = fleet_cap + c, fleet_active + a
      end
    end
    if #names == 0 then return nil, 'busy' end
  end
  local cost = t.cost
  local keyed = t.ranking ~= ''
  if keyed and #names > 1 then
    local w = weighs(t, pl.max_cap)
    local load = (fleet_active + w) * (1 + eps) / fleet_cap
    local rank = 0
    for u in string.gmatch(t.ranking, '[^\n]+') do
      local c = pl.cap[u]
      if c and (not below or (c < below and (pl.act[u] or 0) < c)) then
        if (pl.act[u] or 0) + w <= math.ceil(load * c) and fits(pl, u, weighs(t, c), cost) then
          if rank == 0 then return u, 'affinity' end
          return u, 'load'
        end
        rank = rank + 1
      end
    end
  end
  local room, total = {}, 0
  local plain = t.tasks == 0  -- the common case: its weight is the same everywhere
  for _, u in ipairs(names) do
    if fits(pl, u, plain and t.w or weighs(t, pl.cap[u]), cost) then
      room[#room + 1] = u
      total = total + pl.cap[u] - (pl.act[u] or 0)
    end
  end
  if #room == 0 then return nil, 'busy' end
  local chosen = room[1]
  if #room > 1 then
    local hi, lo = score64(seq, 2654435769, 2135587861)
    local point = (hi * TWO32 + lo) / 18446744073709551616 * total
    for _, u in ipairs(room) do
      point = point - (pl.cap[u] - (pl.act[u] or 0))
      if point < 0 then
        chosen = u
        break
      end
    end
  end
  if keyed and #names == 1 then return chosen, 'affinity' end
  return chosen, 'load'
end

local function bump(key, field, by)
  if redis.call('HINCRBY', key, field, by) <= 0 then redis.call('HDEL', key, field) end
end

local function take(u, w, tokens, tenant)
  local a = redis.call('HINCRBY', K_ACTIVE, u, w)
  local t = 0
  if tokens > 0 then t = redis.call('HINCRBY', K_TOKENS, u, tokens) end
  if tenant ~= '' then redis.call('HINCRBY', K_TACTIVE, tenant, w) end
  local pl = PL
  if pl then
    pl.act[u] = a
    if pl.cap[u] then pl.fleet_active = pl.fleet_active + w end
    if tokens > 0 then pl.tok[u] = t end
  end
end

-- Return `w` slots and `tokens` of `u`; never below zero (a replica given up and back
-- re-registers first).
local function give_back(u, w, tokens, tenant)
  local a = redis.call('HINCRBY', K_ACTIVE, u, -w)
  if a < 0 then
    redis.call('HSET', K_ACTIVE, u, 0)
    w, a = w + a, 0
  end
  if a == 0 and redis.call('HEXISTS', K_POOLS, u) == 0 then
    -- Gone from the pools (its address left DNS): nothing of it stays for every call to read.
    redis.call('HDEL', K_ACTIVE, u)
  end
  local t = 0
  if tokens > 0 then
    t = redis.call('HINCRBY', K_TOKENS, u, -tokens)
    if t <= 0 then
      redis.call('HDEL', K_TOKENS, u)
      t = 0
    end
  end
  if tenant ~= '' then bump(K_TACTIVE, tenant, -w) end
  local pl = PL
  if pl then
    pl.act[u] = a
    if pl.cap[u] then pl.fleet_active = pl.fleet_active - w end
    if tokens > 0 then pl.tok[u] = t end
  end
end

-- A ticket: `w` is the fewest slots it runs in, `tasks` a prompt array's (see `weighs`).
local function parse_ticket(f)
  local r, w, cost, band, tenant, share, maxa, charge, tasks, ranking = string.match(f,
    '^([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t(.*)$')
  return {r = r, w = tonumber(w), cost = tonumber(cost), band = tonumber(band),
          tenant = tenant, share = tonumber(share), maxa = tonumber(maxa),
          charge = tonumber(charge), tasks = tonumber(tasks), ranking = ranking}
end

local function record(t)
  return t.r..'\t'..t.w..'\t'..t.cost..'\t'..t.band..'\t'..t.tenant..'\t'..num(t.share)
    ..'\t'..t.maxa..'\t'..num(t.charge)..'\t'..t.tasks..'\t'..t.ranking
end

-- A grant in `r:<r>`: its upstream, the tokens and slots it holds there, its ticket.
local function parse_grant(v)
  local u, tokens, w, rec = string.match(v, '^g\t([^\t]*)\t([^\t]*)\t([^\t]*)\t(.*)$')
  return u, tonumber(tokens), tonumber(w), rec
end

local function seq_of(m) return tonumber(string.sub(m, 1, 16), 16) end

-- Would `t`'s tenant stay within its max_active with `t`'s slots (on the largest upstream, as
-- the core weighs a prompt array)? (Every slot counts, even for a tenant holding none: one
-- request never passes the limit.)
local function may_run(t)
  if t.tenant == '' or t.maxa < 0 then return true end
  local a = tonumber(redis.call('HGET', K_TACTIVE, t.tenant) or '0')
  return a + weighs(t, pools().max_cap) <= t.maxa
end

-- Can `t` never run: more slots than its tenant's max_active?
local function over_limit(t)
  return t.tenant ~= '' and t.maxa >= 0 and weighs(t, pools().max_cap) > t.maxa
end

local function fair_field(kind, t) return kind..'\t'..t.band..'\t'..t.tenant end

-- `t`'s tag in its band (see the module's docstring); charges its tenant provisionally. A
-- ticket `granted` at once moves the band's virtual time to its tag too.
local function fair_tag(t, seq, granted)
  if t.tenant == '' then return seq end
  local fair = redis.call('HMGET', K_FAIR, 'v\t'..t.band, fair_field('f', t), fair_field('l', t))
  local v = tonumber(fair[1] or '0')
  local start = math.max(v, tonumber(fair[2] or '0'), tonumber(fair[3] or '0'))
  local tag = math.floor(start)
  t.charge = UNIT * weighs(t, pools().max_cap) / t.share
  if granted and tag > v then
    redis.call('HSET', K_FAIR, fair_field('f', t), num(start + t.charge),
               fair_field('l', t), num(start), 'v\t'..t.band, num(tag))
  else
    redis.call('HSET', K_FAIR, fair_field('f', t), num(start + t.charge),
               fair_field('l', t), num(start))
  end
  return tag
end

-- A grant of tag `tag` starts: the band's virtual time follows it.
local function fair_granted(t, tag)
  if t.tenant == '' then return end
  local v = tonumber(redis.call('HGET', K_FAIR, 'v\t'..t.band) or '0')
  if tag > v then redis.call('HSET', K_FAIR, 'v\t'..t.band, num(tag)) end
end

-- Correct `t`'s tenant's finish tag by `by` (a release's real cost, a leaver's refund).
local function fair_correct(t, by)
  if t.tenant == '' or t.charge < 0 or by == 0 then return end
  redis.call('HINCRBYFLOAT', K_FAIR, fair_field('f', t), num(by))
end

local function enqueue(m, t, tag)
  redis.call('ZADD', K_LINE, tag - t.band * BAND_SPAN, m)
  redis.call('HSET', K_TICKETS, m, record(t))
  redis.call('HSET', held_key(t.r), m, 'w')
  if t.tenant ~= '' then redis.call('HINCRBY', K_TQUEUED, t.tenant, 1) end
end

-- Take `m` (ticket `t`) out of the line; a leaver's provisional charge goes back.
local function unline(m, t, refund)
  redis.call('ZREM', K_LINE, m)
  redis.call('HDEL', K_TICKETS, m)
  if t.tenant ~= '' then bump(K_TQUEUED, t.tenant, -1) end
  if refund then fair_correct(t, -t.charge) end
end

-- Slots of `u` are now `m`'s (ticket `t`), as many as it takes there; returns the grant's
-- number and those slots.
local function hold_grant(m, u, t)
  local n = redis.call('INCR', K_GRANTED)
  local pl = PL or pools()
  local w = t.tasks == 0 and t.w or weighs(t, pl.cap[u])
  local tokens = charge_tokens(pl, u, t.cost)
  take(u, w, tokens, t.tenant)
  redis.call('HSET', held_key(t.r), m, 'g\t'..u..'\t'..tokens..'\t'..w..'\t'..record(t))
  return n, w
end

-- `m` (ticket `t`, line score `score`) leaves the line granted on `u`. A grant to `quiet` (the
-- ENTER running) is returned rather than published.
local function grant(m, t, u, why, score, quiet)
  unline(m, t, false)
  fair_granted(t, tonumber(score) + t.band * BAND_SPAN)
  local n, w = hold_grant(m, u, t)
  if m == quiet then return {u, why, n, w} end
  redis.call('PUBLISH', P..'ch:'..t.r, m..'\t'..u..'\t'..why..'\t'..n..'\t'..w)
  return nil
end

-- Is any upstream with fewer than `floor` slots not full?
local function open_below(pl, floor)
  for _, u in ipairs(pl.names) do
    local c = pl.cap[u]
    if c < floor and (pl.act[u] or 0) < c then return true end
  end
  return false
end

-- The head (at `rank` in the line, `floor` slots at least) waits: grant the waiters behind it
-- on upstreams it can never run on, as the core's `_backfill`. In the line's order (with
-- tenants, the fair order: the score is the start tag); a waiter that does not fit yet keeps
-- the upstreams it could use for itself, from everyone behind it: `floor` falls to its least.
-- Bounded, so that a release behind a long line of heavy waiters stays cheap.
local function backfill(eps, quiet, rank, floor, got)
  local pl = pools()
  if not open_below(pl, floor) then return got end
  -- In chunks, each ticket's least read first: behind a long line of waiters too large for
  -- every open upstream, a release costs one ZRANGE and one HMGET per 64 of them.
  local first, last = rank + 1, rank + BACKFILL_SCAN - 1
  while first <= last do
    local upto = math.min(first + 63, last)
    local members = redis.call('ZRANGE', K_LINE, first, upto)
    if #members == 0 then return got end
    local records = redis.call('HMGET', K_TICKETS, unpack(members))
    local granted = 0
    for j = 1, #members do
      local f = records[j]
      if f and tonumber(string.match(f, '^[^\t]*\t(%d+)')) < floor then
        local m, t = members[j], parse_ticket(f)
        if not over_limit(t) and may_run(t) then
          local u, why = choose(t, eps, seq_of(m), floor)
          if u then
            got = grant(m, t, u, why, redis.call('ZSCORE', K_LINE, m), quiet) or got
            granted = granted + 1
          else
            floor = t.w
          end
          if not open_below(pl, floor) then return got end
        end
      end
    end
    -- Those granted left the line: the next chunk starts that much nearer its head.
    first = upto + 1 - granted
    last = last - granted
  end
  return got
end

-- Hand free slots to the line in its order: the first ticket whose tenant may run (a tenant at
-- its max_active is passed over, among the first SCAN) gets them if they fit, else nobody
-- does but those behind it that `backfill` lets run where it cannot. A grant to `quiet` (the
-- ENTER running) is returned rather than published.
local function dispatch(eps, quiet)
  local got = nil
  local wide = false  -- the head alone, unless its tenant was found at its max_active
  while true do
    local heads = redis.call('ZRANGE', K_LINE, 0, wide and SCAN - 1 or 0, 'WITHSCORES')
    if #heads == 0 then return got end
    local moved = false
    for i = 1, #heads, 2 do
      local m = heads[i]
      local f = redis.call('HGET', K_TICKETS, m)
      if not f then
        redis.call('ZREM', K_LINE, m)
        moved = true
        break
      end
      local t = parse_ticket(f)
      if may_run(t) or over_limit(t) then
        local u, why = choose(t, eps, seq_of(m))
        if over_limit(t) or (u == nil and why == 'large') then
          -- No upstream has that many slots any more, or its tenant's max_active was lowered
          -- under them: refuse it rather than block the line.
          unline(m, t, true)
          redis.call('HDEL', held_key(t.r), m)
          redis.call('PUBLISH', P..'ch:'..t.r, m..'\t\tlarge\t0\t0')
        elseif u == nil then
          if why == 'busy' and #pools().names > 1 then
            return backfill(eps, quiet, (i - 1) / 2, t.w, got)
          end
          return got
        else
          got = grant(m, t, u, why, heads[i + 1], quiet) or got
        end
        moved = true
        break
      end
    end
    if not moved then
      if wide then return got end
      wide = true
    end
  end
end

-- Forget whatever `m` is of replica `r`: its place in the line, or its grant (then also the
-- ticket, for the release's correction).
local function drop(r, m)
  local v = redis.call('HGET', held_key(r), m)
  if not v then return 'none' end
  redis.call('HDEL', held_key(r), m)
  if v == 'w' then
    local f = redis.call('HGET', K_TICKETS, m)
    if f then unline(m, parse_ticket(f), true) else redis.call('ZREM', K_LINE, m) end
    return 'left'
  end
  local u, tokens, w, rec = parse_grant(v)
  local t = parse_ticket(rec)
  give_back(u, w, tokens, t.tenant)
  return 'released', t
end

-- Forget everything replica `r` holds.
local function forget(r)
  local held = redis.call('HGETALL', held_key(r))
  for i = 1, #held, 2 do drop(r, held[i]) end
  redis.call('DEL', held_key(r))
end

-- Forget `r`'s places in the line; true if it still holds grants.
local function unplace(r)
  local held = redis.call('HGETALL', held_key(r))
  local grants = false
  for i = 1, #held, 2 do
    if held[i + 1] == 'w' then drop(r, held[i]) else grants = true end
  end
  return grants
end

-- `r`'s heartbeat (lease) renewed for `ttl` ms; its grants are kept `kept` ms past its expiry.
local function lease(r, ttl, kept, now)
  redis.call('SET', hb_key(r), '1', 'PX', ttl)
  redis.call('ZADD', K_REPLICAS, now + ttl, r)
  redis.call('HSET', K_KEPT, r, kept)
  redis.call('HDEL', K_GIVEN_UP, r)
end

local function unregister(r)
  forget(r)
  redis.call('ZREM', K_REPLICAS, r)
  redis.call('HDEL', K_KEPT, r)
  redis.call('HDEL', K_GIVEN_UP, r)
end

-- Give up replicas whose heartbeat expired. Their places go back at once. Their grants stay
-- counted for as long as the replica said (`kept`): one cut off from Redis (not dead) still
-- runs them, and gates alone on their slots meanwhile (app/replicas/shared.py), so that nobody else
-- may take those slots before it has stopped; then they go back too.
local function reap(now)
  local dead = redis.call('ZRANGEBYSCORE', K_REPLICAS, '-inf', now)
  local reaped = 0
  for _, r in ipairs(dead) do
    if redis.call('EXISTS', hb_key(r)) == 0 then
      local kept = tonumber(redis.call('HGET', K_KEPT, r) or '0')
      if redis.call('HEXISTS', K_GIVEN_UP, r) == 0 and unplace(r) and kept > 0 then
        redis.call('HSET', K_GIVEN_UP, r, 1)
        redis.call('ZADD', K_REPLICAS, now + kept, r)
      else
        unregister(r)
      end
      reaped = reaped + 1
    end
  end
  return reaped
end

local function queue_limit(fleet_cap, max_queue, per_slot, min_queue)
  -- QueuePolicy.limit in Lua; -1 is "not set", and a result of -1 is an unbounded line.
  if max_queue >= 0 then
    if max_queue == 0 then return -1 end
    return max_queue
  end
  if per_slot < 0 then
    local floor = min_queue
    if floor < 0 then floor = 64 end
    return math.max(16 * fleet_cap, floor)
  end
  if per_slot == 0 then return -1 end
  return math.max(per_slot * fleet_cap, math.max(min_queue, 0))
end

local function hold_s()
  return redis.call('GET', K_HOLD) or '-1'
end

-- The fleet's capacity, active, queued, hold, replicas, and grants so far (the `granted`
-- counter: a waiter's place moves up by the grants made since it entered).
-- A replica that knows no budget for an upstream has not learned it (yet): a budget another
-- replica told for the same slot count stays; a new slot count (a restarted server) drops it.
local function set_unbudgeted(u, c)
  local was = redis.call('HGET', K_POOLS, u)
  if was and string.match(was, '^(%d+)') == c then return end
  redis.call('HSET', K_POOLS, u, c)
end

local function figures()
  local pl = pools()
  return {tostring(pl.fleet_cap), tostring(pl.fleet_active), tostring(redis.call('ZCARD', K_LINE)),
          hold_s(), tostring(redis.call('ZCARD', K_REPLICAS)), redis.call('GET', K_GRANTED) or '0'}
end
"""

#: ARGV: replica, ticket id, weight, cost, ranking, eps, band, tag ('' = computed: the fair
#: start tag for a tenant, else the arrival number), max_queue, queue_per_slot, min_queue (-1:
#: not set), tenant ('' = none), share, max_active, max_queued (-1: none), tasks (a prompt
#: array's, else 0: see `weighs`; weight is then its least).
#: -> {'grant', member, upstream, reason, grant number, slots held}
#:    | {'queued', member, position, limit, grants so far}
#:    | {'full', limit, figures...} | {'tenant_full', tenant queued, tenant active, figures...}
#:    | {'unknown', figures...} | {'large', most slots it may have, figures...} | {'fenced'}
#: ('large': more than the largest upstream's slots, or than its tenant's max_active)
ENTER = r"""
local me, id, w, cost = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
if redis.call('EXISTS', hb_key(me)) == 0 then return {'fenced'} end
local pl = pools()
if pl.fleet_cap == 0 then return {'unknown', unpack(figures())} end
if w > pl.max_cap then return {'large', tostring(pl.max_cap), unpack(figures())} end
local t = {r = me, w = w, cost = cost, band = tonumber(ARGV[7]), tenant = ARGV[12],
           share = tonumber(ARGV[13]), maxa = tonumber(ARGV[14]), charge = 0,
           tasks = tonumber(ARGV[16]), ranking = ARGV[5]}
if over_limit(t) then return {'large', ARGV[14], unpack(figures())} end
local seq = redis.call('INCR', K_SEQ)
local m = string.format('%016x', seq)..'|'..id
local queued = redis.call('ZCARD', K_LINE)
local eps = tonumber(ARGV[6])
if queued == 0 and may_run(t) then
  local u, why = choose(t, eps, seq)
  if u then
    fair_tag(t, seq, true)
    local n, held = hold_grant(m, u, t)
    return {'grant', m, u, why, tostring(n), tostring(held)}
  end
end
local limit = queue_limit(pl.fleet_cap, tonumber(ARGV[9]), tonumber(ARGV[10]),
                          tonumber(ARGV[11]))
if limit >= 0 and queued >= limit then
  return {'full', tostring(limit), unpack(figures())}
end
local max_queued = tonumber(ARGV[15])
if t.tenant ~= '' and max_queued >= 0 then
  local mine = tonumber(redis.call('HGET', K_TQUEUED, t.tenant) or '0')
  if mine >= max_queued then
    return {'tenant_full', tostring(mine), redis.call('HGET', K_TACTIVE, t.tenant) or '0',
            unpack(figures())}
  end
end
local tag
if ARGV[8] ~= '' then tag = tonumber(ARGV[8]) else tag = fair_tag(t, seq) end
enqueue(m, t, tag)
if queued > 0 and pl.fleet_active < pl.fleet_cap then
  -- Free slots with a line: its head waits for more, or its tenant is at its max_active, or
  -- this ticket goes ahead of it. Whoever may run now does.
  local got = dispatch(eps, m)
  if got then return {'grant', m, got[1], got[2], tostring(got[3]), tostring(got[4])} end
end
return {'queued', m, tostring(redis.call('ZRANK', K_LINE, m) + 1), tostring(limit),
        redis.call('GET', K_GRANTED) or '0'}
"""

#: ARGV: replica, member, hold_s ('' = not observed), eps, ewma alpha
#: -> 'released' | 'left' | 'none'
#: A release and a leave are one script: a waiter that gives up just as its grant is published
#: finds itself granted, and returns the slots.
RELEASE = r"""
local what, t = drop(ARGV[1], ARGV[2])
if what == 'released' and ARGV[3] ~= '' then
  local h = tonumber(ARGV[3])
  local old = tonumber(redis.call('GET', K_HOLD) or '-1')
  if old <= 0 then old = h end
  redis.call('SET', K_HOLD, tostring(old + tonumber(ARGV[5]) * (h - old)))
  -- The tenant pays for the slot time it held (in average holds), not for the one average
  -- hold it was charged.
  if old > 0 then fair_correct(t, t.charge * (h / old - 1)) end
end
if what ~= 'none' then dispatch(tonumber(ARGV[4])) end
return what
"""

#: ARGV: replica, ttl_ms, eps, kept_ms -> {'ok', figures..., then upstream, budget of each
#: budgeted one} | {'fenced'}
HEARTBEAT = r"""
local me, ttl = ARGV[1], tonumber(ARGV[2])
if redis.call('EXISTS', hb_key(me)) == 0 then return {'fenced'} end
local now = now_ms()
lease(me, ttl, tonumber(ARGV[4]), now)
if reap(now) > 0 then dispatch(tonumber(ARGV[3])) end
local out = {'ok', unpack(figures())}
-- The budgets one replica learned (a 500 from a shared cache), for the others to learn too.
for u, b in pairs(pools().bud) do out[#out + 1] = u; out[#out + 1] = tostring(b) end
return out
"""

#: ARGV: replica, ttl_ms, eps, kept_ms, n_pools, n_grants, n_waiters, then the pools
#: (upstream, capacity, budget or '': none learned here, another's stays), the grants
#: (member, upstream, slots held, least, tasks, cost, band, tenant, share, max_active,
#: ranking) and the waiters in order (id, least, tasks, cost, ranking, band, tag, tenant,
#: share, max_active).
#: -> {figures..., new member of each waiter in order...}
#:
#: Replaces whatever Redis holds for the replica with what the replica says it holds: after it
#: was given up, after Redis restarted empty, or after Redis was slow and may have run commands
#: whose answers the replica never read. A grant registered again keeps the charge it had (its
#: release corrects nothing); its waiters get new tags.
REJOIN = r"""
local me, ttl, eps = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local n_pools, n_grants, n_waiters = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
forget(me)
local now = now_ms()
lease(me, ttl, tonumber(ARGV[4]), now)
local i = 8
for _ = 1, n_pools do
  if ARGV[i + 2] == '' then
    set_unbudgeted(ARGV[i], ARGV[i + 1])
  else
    redis.call('HSET', K_POOLS, ARGV[i], ARGV[i + 1]..'\t'..ARGV[i + 2])
  end
  i = i + 3
end
PL = nil
for _ = 1, n_grants do
  local t = {r = me, w = tonumber(ARGV[i + 3]), tasks = tonumber(ARGV[i + 4]),
             cost = tonumber(ARGV[i + 5]), band = tonumber(ARGV[i + 6]), tenant = ARGV[i + 7],
             share = tonumber(ARGV[i + 8]), maxa = tonumber(ARGV[i + 9]), charge = -1,
             ranking = ARGV[i + 10]}
  local u, w = ARGV[i + 1], tonumber(ARGV[i + 2])
  local tokens = charge_tokens(pools(), u, t.cost)
  take(u, w, tokens, t.tenant)
  redis.call('HSET', held_key(me), ARGV[i], 'g\t'..u..'\t'..tokens..'\t'..w..'\t'..record(t))
  i = i + 11
end
local members = {}
for _ = 1, n_waiters do
  local seq = redis.call('INCR', K_SEQ)
  local m = string.format('%016x', seq)..'|'..ARGV[i]
  local t = {r = me, w = tonumber(ARGV[i + 1]), tasks = tonumber(ARGV[i + 2]),
             cost = tonumber(ARGV[i + 3]), band = tonumber(ARGV[i + 5]), tenant = ARGV[i + 7],
             share = tonumber(ARGV[i + 8]), maxa = tonumber(ARGV[i + 9]), charge = 0,
             ranking = ARGV[i + 4]}
  local tag
  if ARGV[i + 6] ~= '' then tag = tonumber(ARGV[i + 6]) else tag = fair_tag(t, seq) end
  enqueue(m, t, tag)
  members[#members + 1] = m
  i = i + 10
end
reap(now)
dispatch(eps)
local out = figures()
for _, m in ipairs(members) do out[#out + 1] = m end
return out
"""

#: ARGV: upstream, capacity ('' = unknown), eps, budget in tokens ('' = it does not bind; '?' =
#: none learned here, another replica's for the same slot count stays) -> 'ok'
RESIZE = r"""
if ARGV[2] == '' then
  redis.call('HDEL', K_POOLS, ARGV[1])
  if tonumber(redis.call('HGET', K_ACTIVE, ARGV[1]) or '0') <= 0 then
    redis.call('HDEL', K_ACTIVE, ARGV[1])
  end
elseif ARGV[4] == '?' then
  set_unbudgeted(ARGV[1], ARGV[2])
  dispatch(tonumber(ARGV[3]))
elseif ARGV[4] == '' then
  redis.call('HSET', K_POOLS, ARGV[1], ARGV[2])
  dispatch(tonumber(ARGV[3]))
else
  redis.call('HSET', K_POOLS, ARGV[1], ARGV[2]..'\t'..ARGV[4])
  dispatch(tonumber(ARGV[3]))
end
return 'ok'
"""

#: ARGV: replica, member, eps -> 'queued' | 'none'
#: Its upstream did not take the request: the grant's slots go back and the ticket waits again
#: at the head of the line (a score under the head's and under its band's tags), for
#: whichever upstream has room first.
REROUTE = r"""
local me, m = ARGV[1], ARGV[2]
local v = redis.call('HGET', held_key(me), m)
if not v or v == 'w' then return 'none' end
local u, tokens, w, rec = parse_grant(v)
local t = parse_ticket(rec)
-- The slots it held there go back; it is weighed again where it is granted next.
give_back(u, w, tokens, t.tenant)
redis.call('HDEL', held_key(me), m)
local head = redis.call('ZRANGE', K_LINE, 0, 0, 'WITHSCORES')
local score = -t.band * BAND_SPAN
if #head > 0 then score = math.min(tonumber(head[2]) - 1, score) end
redis.call('ZADD', K_LINE, score, m)
redis.call('HSET', K_TICKETS, m, rec)
redis.call('HSET', held_key(me), m, 'w')
if t.tenant ~= '' then redis.call('HINCRBY', K_TQUEUED, t.tenant, 1) end
dispatch(tonumber(ARGV[3]))
return 'queued'
"""

#: ARGV: replica, old upstream, new upstream -> 'ok'
#: An upstream known by another name now (an address of its name, upstreams/fleet.py): the old name
#: leaves the pools, and the replica's grants there move to the new one, their slots and tokens
#: with them, so that its running requests still count against its slots.
REKEY = r"""
local me, old, new = ARGV[1], ARGV[2], ARGV[3]
redis.call('HDEL', K_POOLS, old)
local held = redis.call('HGETALL', held_key(me))
for i = 1, #held, 2 do
  local u, tokens, w, rec = parse_grant(held[i + 1])
  if u == old then
    give_back(old, w, tokens, '')
    take(new, w, tokens, '')
    redis.call('HSET', held_key(me), held[i], 'g\t'..new..'\t'..tokens..'\t'..w..'\t'..rec)
  end
end
return 'ok'
"""

#: ARGV: tenant, share, max_active (-1: none), eps -> 'ok' (its limits reloaded: its waiters
#: take them, so that a raised max_active lets them run on free slots at once)
RETUNE = r"""
local heads = redis.call('ZRANGE', K_LINE, 0, -1)
for _, m in ipairs(heads) do
  local f = redis.call('HGET', K_TICKETS, m)
  if f then
    local t = parse_ticket(f)
    if t.tenant == ARGV[1] then
      t.share, t.maxa = tonumber(ARGV[2]), tonumber(ARGV[3])
      redis.call('HSET', K_TICKETS, m, record(t))
    end
  end
end
dispatch(tonumber(ARGV[4]))
return 'ok'
"""

#: ARGV: replica, eps -> 'ok' (a replica leaving for good: what it holds goes back at once)
RETIRE = r"""
unregister(ARGV[1])
redis.call('DEL', hb_key(ARGV[1]))
dispatch(tonumber(ARGV[2]))
return 'ok'
"""


_COMMON_CODE = _COMMON.replace("@BACKFILL_SCAN@", str(BACKFILL_SCAN))

_SCRIPTS = {
    "ENTER": ENTER,
    "RELEASE": RELEASE,
    "HEARTBEAT": HEARTBEAT,
    "REJOIN": REJOIN,
    "RESIZE": RESIZE,
    "RETIRE": RETIRE,
    "REROUTE": REROUTE,
    "REKEY": REKEY,
    "RETUNE": RETUNE,
}


def script(body: str) -> str:
    """`body` as a script for EVAL, with the helpers it calls."""
    return _COMMON_CODE + "setup(KEYS)\n" + body


def _library() -> tuple[str, dict[str, str]]:
    # Named by a hash of its code: replicas of different versions each call their own.
    code = _COMMON_CODE + "".join(
        f"redis.register_function('{{lib}}_{name.lower()}', function(KEYS, ARGV)\n"
        f"setup(KEYS)\n{body}end)\n"
        for name, body in _SCRIPTS.items()
    )
    lib = "slotgate_" + hashlib.sha256(code.encode()).hexdigest()[:16]
    functions = {name: f"{lib}_{name.lower()}" for name in _SCRIPTS}
    return f"#!lua name={lib}\n" + code.replace("{lib}", lib), functions


#: The scripts as one function library (FUNCTION LOAD): its helpers are made once, when it is
#: loaded, not at every call as an EVAL script's are (about 6 us of each call). LIBRARY's text,
#: FUNCTIONS the name of each script's function in it.
LIBRARY, FUNCTIONS = _library()
