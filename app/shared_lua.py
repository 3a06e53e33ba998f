"""The server-side scripts of the shared admission (app/shared.py), in Lua.

Every script takes one key, the fleet's prefix `slotgate:{<fleet>}:`; the keys it touches are
that prefix and a suffix, so they all hash to one cluster slot. The keys:

- `pools`     hash upstream -> capacity (the slots its /props reports; absent: unknown)
- `active`    hash upstream -> slots granted on it
- `line`      sorted set of waiting tickets; score = band * BAND_SPAN + tag, members
              `<seq as 16 hex digits>|<ticket id>`, so that equal scores fall back to arrival
- `tickets`   hash member -> "replica TAB weight TAB cost TAB ranking" (ranking: upstream ids
              joined by newlines, best first)
- `seq`       the arrival counter; `granted` the grant counter (a grant's place, read back)
- `hold`      the moving average of slot hold times, in seconds
- `replicas`  sorted set replica -> expiry of its last heartbeat (server time, ms)
- `hb:<r>`    a replica's heartbeat, with a TTL; `r:<r>` hash member -> "w" (waiting) or
              "g TAB upstream TAB weight" (granted): what the replica holds
- channel `ch:<r>`: "member TAB upstream TAB reason TAB grant number" per grant handed over.
"""

from __future__ import annotations

#: A band's span of the score: tags (arrival numbers or virtual start times) stay below it and
#: the score stays an exact integer in a double up to band 511.
BAND_SPAN = 2**44

_COMMON = r"""
local P = KEYS[1]
local K_POOLS, K_ACTIVE, K_LINE, K_TICKETS = P..'pools', P..'active', P..'line', P..'tickets'
local K_SEQ, K_GRANTED, K_HOLD, K_REPLICAS = P..'seq', P..'granted', P..'hold', P..'replicas'
local BAND_SPAN = 17592186044416
local function held_key(r) return P..'r:'..r end
local function hb_key(r) return P..'hb:'..r end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The pools as tables, with the fleet's sums over the upstreams whose capacity is known.
local function pools()
  local cap, act = {}, {}
  local fleet_cap, fleet_active, max_cap = 0, 0, 0
  local raw = redis.call('HGETALL', K_POOLS)
  for i = 1, #raw, 2 do
    local c = tonumber(raw[i + 1])
    cap[raw[i]] = c
    fleet_cap = fleet_cap + c
    if c > max_cap then max_cap = c end
  end
  raw = redis.call('HGETALL', K_ACTIVE)
  for i = 1, #raw, 2 do
    local a = tonumber(raw[i + 1])
    act[raw[i]] = a
    if cap[raw[i]] then fleet_active = fleet_active + a end
  end
  return cap, act, fleet_cap, fleet_active, max_cap
end

-- The upstream for `w` slots, as app/routing.py's `choose`: the ranking's first upstream with
-- room and within the bounded load (active + w <= ceil((fleet_active + w) * (1 + eps) /
-- fleet_cap * cap)), else the least loaded with room (lowest share taken, then most free
-- slots); the reason is 'affinity' for the ranking's first, else 'load'; nil and why not
-- ('unknown', 'large', 'busy') when none has room.
local function choose(ranking, w, eps)
  local cap, act, fleet_cap, fleet_active, max_cap = pools()
  if fleet_cap == 0 then return nil, 'unknown' end
  if w > max_cap then return nil, 'large' end
  local load = (fleet_active + w) * (1 + eps) / fleet_cap
  local rank = 0
  for u in string.gmatch(ranking, '[^\n]+') do
    local c = cap[u]
    if c then
      local a = (act[u] or 0) + w
      if a <= c and a <= math.ceil(load * c) then
        if rank == 0 then return u, 'affinity' end
        return u, 'load'
      end
      rank = rank + 1
    end
  end
  local best, best_share, best_free = nil, nil, nil
  for u, c in pairs(cap) do
    local a = (act[u] or 0) + w
    if a <= c then
      local share, free = a / c, c - a
      if best == nil or share < best_share
          or (share == best_share and (free > best_free or (free == best_free and u < best))) then
        best, best_share, best_free = u, share, free
      end
    end
  end
  if best then return best, 'load' end
  return nil, 'busy'
end

local function take(u, w)
  redis.call('HINCRBY', K_ACTIVE, u, w)
end

-- Return `w` slots of `u`; never below zero (a replica given up and back re-registers first).
local function give_back(u, w)
  if redis.call('HINCRBY', K_ACTIVE, u, -w) < 0 then redis.call('HSET', K_ACTIVE, u, 0) end
end

local function parse_ticket(f)
  return string.match(f, '^([^\t]*)\t([^\t]*)\t([^\t]*)\t(.*)$')
end

-- `w` slots of `u` are now `m`'s, of replica `r`; returns the grant's number.
local function hold_grant(r, m, u, w)
  local n = redis.call('INCR', K_GRANTED)
  take(u, w)
  redis.call('HSET', held_key(r), m, 'g\t'..u..'\t'..w)
  return n
end

-- Hand a waiter its grant: one message, on its own replica's channel only.
local function grant(r, m, u, w, why)
  local n = hold_grant(r, m, u, w)
  redis.call('PUBLISH', P..'ch:'..r, m..'\t'..u..'\t'..why..'\t'..n)
end

-- Hand free slots to the head of the line, and only the head: if it does not fit, nobody.
local function dispatch(eps)
  while true do
    local head = redis.call('ZRANGE', K_LINE, 0, 0)
    if #head == 0 then return end
    local m = head[1]
    local f = redis.call('HGET', K_TICKETS, m)
    if not f then
      redis.call('ZREM', K_LINE, m)
    else
      local r, w, _cost, ranking = parse_ticket(f)
      w = tonumber(w)
      local u, why = choose(ranking, w, eps)
      if u == nil and why == 'large' then
        -- No upstream has that many slots any more: refuse it rather than block the line.
        redis.call('ZREM', K_LINE, m)
        redis.call('HDEL', K_TICKETS, m)
        redis.call('HDEL', held_key(r), m)
        redis.call('PUBLISH', P..'ch:'..r, m..'\t\tlarge\t0')
      elseif u == nil then
        return
      else
        redis.call('ZREM', K_LINE, m)
        redis.call('HDEL', K_TICKETS, m)
        grant(r, m, u, w, why)
      end
    end
  end
end

-- Forget whatever `m` is of replica `r`: its place in the line, or its grant.
local function drop(r, m)
  local v = redis.call('HGET', held_key(r), m)
  if not v then return 'none' end
  redis.call('HDEL', held_key(r), m)
  if v == 'w' then
    redis.call('ZREM', K_LINE, m)
    redis.call('HDEL', K_TICKETS, m)
    return 'left'
  end
  local u, w = string.match(v, '^g\t([^\t]*)\t(%d+)$')
  give_back(u, tonumber(w))
  return 'released'
end

-- Forget everything replica `r` holds.
local function forget(r)
  local held = redis.call('HGETALL', held_key(r))
  for i = 1, #held, 2 do drop(r, held[i]) end
  redis.call('DEL', held_key(r))
end

-- Give up replicas whose heartbeat expired: their grants and places go back.
local function reap(now)
  local dead = redis.call('ZRANGEBYSCORE', K_REPLICAS, '-inf', now)
  local reaped = 0
  for _, r in ipairs(dead) do
    if redis.call('EXISTS', hb_key(r)) == 0 then
      forget(r)
      redis.call('ZREM', K_REPLICAS, r)
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

local function figures(fleet_cap, fleet_active)
  return {tostring(fleet_cap), tostring(fleet_active), tostring(redis.call('ZCARD', K_LINE)),
          hold_s(), tostring(redis.call('ZCARD', K_REPLICAS))}
end
"""

#: ARGV: replica, ticket id, weight, cost, ranking, eps, band, tag ('' = the arrival number),
#: max_queue, queue_per_slot, min_queue (-1: not set).
#: -> {'grant', member, upstream, reason, grant number} | {'queued', member, position}
#:    | {'full' | 'unknown' | 'large' | 'fenced', figures...}
ENTER = (
    _COMMON
    + r"""
local me, id, w = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('EXISTS', hb_key(me)) == 0 then return {'fenced'} end
local _cap, _act, fleet_cap, fleet_active, max_cap = pools()
if fleet_cap == 0 then return {'unknown', unpack(figures(0, 0))} end
if w > max_cap then
  return {'large', tostring(max_cap), unpack(figures(fleet_cap, fleet_active))}
end
local seq = redis.call('INCR', K_SEQ)
local m = string.format('%016x', seq)..'|'..id
local queued = redis.call('ZCARD', K_LINE)
local eps = tonumber(ARGV[6])
if queued == 0 then
  local u, why = choose(ARGV[5], w, eps)
  if u then
    local n = hold_grant(me, m, u, w)
    return {'grant', m, u, why, tostring(n)}
  end
end
local limit = queue_limit(fleet_cap, tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11]))
if limit >= 0 and queued >= limit then
  return {'full', tostring(limit), unpack(figures(fleet_cap, fleet_active))}
end
local tag = seq
if ARGV[8] ~= '' then tag = tonumber(ARGV[8]) end
redis.call('ZADD', K_LINE, tonumber(ARGV[7]) * BAND_SPAN + tag, m)
redis.call('HSET', K_TICKETS, m, me..'\t'..w..'\t'..ARGV[4]..'\t'..ARGV[5])
redis.call('HSET', held_key(me), m, 'w')
return {'queued', m, tostring(redis.call('ZRANK', K_LINE, m) + 1), tostring(limit)}
"""
)

#: ARGV: replica, member, hold_s ('' = not observed), eps, ewma alpha
#: -> 'released' | 'left' | 'none'
#: A release and a leave are one script: a waiter that gives up just as its grant is published
#: finds itself granted, and returns the slots.
RELEASE = (
    _COMMON
    + r"""
local what = drop(ARGV[1], ARGV[2])
if what == 'released' and ARGV[3] ~= '' then
  local h = tonumber(ARGV[3])
  local old = tonumber(redis.call('GET', K_HOLD) or '-1')
  if old < 0 then old = h end
  redis.call('SET', K_HOLD, tostring(old + tonumber(ARGV[5]) * (h - old)))
end
if what ~= 'none' then dispatch(tonumber(ARGV[4])) end
return what
"""
)

#: ARGV: replica, ttl_ms, eps -> {'ok', figures...} | {'fenced'}
HEARTBEAT = (
    _COMMON
    + r"""
local me, ttl = ARGV[1], tonumber(ARGV[2])
if redis.call('EXISTS', hb_key(me)) == 0 then return {'fenced'} end
local now = now_ms()
redis.call('SET', hb_key(me), '1', 'PX', ttl)
redis.call('ZADD', K_REPLICAS, now + ttl, me)
if reap(now) > 0 then dispatch(tonumber(ARGV[3])) end
local _cap, _act, fleet_cap, fleet_active = pools()
return {'ok', unpack(figures(fleet_cap, fleet_active))}
"""
)

#: ARGV: replica, ttl_ms, eps, n_pools, n_grants, n_waiters, then the pools (upstream,
#: capacity), the grants (member, upstream, weight) and the waiters in order (id, weight, cost,
#: ranking, band, tag).
#: -> {figures..., new member of each waiter in order...}
#:
#: Replaces whatever Redis holds for the replica with what the replica says it holds: after it
#: was given up, after Redis restarted empty, or after Redis was slow and may have run commands
#: whose answers the replica never read.
REJOIN = (
    _COMMON
    + r"""
local me, ttl, eps = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local n_pools, n_grants, n_waiters = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
forget(me)
local now = now_ms()
redis.call('SET', hb_key(me), '1', 'PX', ttl)
redis.call('ZADD', K_REPLICAS, now + ttl, me)
local i = 7
for _ = 1, n_pools do
  redis.call('HSET', K_POOLS, ARGV[i], ARGV[i + 1])
  i = i + 2
end
for _ = 1, n_grants do
  take(ARGV[i + 1], tonumber(ARGV[i + 2]))
  redis.call('HSET', held_key(me), ARGV[i], 'g\t'..ARGV[i + 1]..'\t'..ARGV[i + 2])
  i = i + 3
end
local members = {}
for _ = 1, n_waiters do
  local seq = redis.call('INCR', K_SEQ)
  local m = string.format('%016x', seq)..'|'..ARGV[i]
  local tag = seq
  if ARGV[i + 5] ~= '' then tag = tonumber(ARGV[i + 5]) end
  redis.call('ZADD', K_LINE, tonumber(ARGV[i + 4]) * BAND_SPAN + tag, m)
  redis.call('HSET', K_TICKETS, m, me..'\t'..ARGV[i + 1]..'\t'..ARGV[i + 2]..'\t'..ARGV[i + 3])
  redis.call('HSET', held_key(me), m, 'w')
  members[#members + 1] = m
  i = i + 6
end
reap(now)
dispatch(eps)
local _cap, _act, fleet_cap, fleet_active = pools()
local out = figures(fleet_cap, fleet_active)
for _, m in ipairs(members) do out[#out + 1] = m end
return out
"""
)

#: ARGV: upstream, capacity ('' = unknown), eps -> 'ok'
RESIZE = (
    _COMMON
    + r"""
if ARGV[2] == '' then
  redis.call('HDEL', K_POOLS, ARGV[1])
else
  redis.call('HSET', K_POOLS, ARGV[1], ARGV[2])
  dispatch(tonumber(ARGV[3]))
end
return 'ok'
"""
)

#: ARGV: replica, member, weight, cost, ranking, eps -> 'queued' | 'none'
#: Its upstream did not take the request: the grant's slots go back and the ticket waits again
#: at the head of the line (a score under the head's), for whichever upstream has room first.
REROUTE = (
    _COMMON
    + r"""
local me, m = ARGV[1], ARGV[2]
local v = redis.call('HGET', held_key(me), m)
if not v or v == 'w' then return 'none' end
local u, w = string.match(v, '^g\t([^\t]*)\t(%d+)$')
give_back(u, tonumber(w))
local head = redis.call('ZRANGE', K_LINE, 0, 0, 'WITHSCORES')
local score = 0
if #head > 0 then score = math.min(tonumber(head[2]) - 1, 0) end
redis.call('ZADD', K_LINE, score, m)
redis.call('HSET', K_TICKETS, m, me..'\t'..ARGV[3]..'\t'..ARGV[4]..'\t'..ARGV[5])
redis.call('HSET', held_key(me), m, 'w')
dispatch(tonumber(ARGV[6]))
return 'queued'
"""
)

#: ARGV: replica -> 'ok' (a replica leaving for good: what it holds goes back at once)
RETIRE = (
    _COMMON
    + r"""
forget(ARGV[1])
redis.call('DEL', hb_key(ARGV[1]))
redis.call('ZREM', K_REPLICAS, ARGV[1])
dispatch(tonumber(ARGV[2]))
return 'ok'
"""
)
