local P, K_POOLS, K_ACTIVE, K_LINE, K_TICKETS, K_SEQ, K_GRANTED, K_HOLD, K_REPLICAS
local K_TOKENS, K_FAIR, K_TACTIVE, K_TQUEUED, K_KEPT, K_GIVEN_UP
-- The pools, read once per call and kept in step by `take` and `give_back` (see `pools`).
local PL = nil

-- The policy's numbers, each call's first arguments (app/replicas/lua/__init__.py's POLICY):
-- a band's span of the score, tickets `dispatch` looks at past heads whose tenant is at its
-- max_active, waiters a backfill looks at, the fair tags' unit (an average hold), and the
-- line's default bound (slots times PER_SLOT, MIN_QUEUE at least).
local BAND_SPAN, SCAN, BACKFILL_SCAN, UNIT, PER_SLOT, MIN_QUEUE
local N_POLICY = 6

-- Each call: the policy's numbers taken off the front of `argv` (the script's own arguments
-- follow), the fleet's keys (the call's one key is their prefix), the pools unread.
local function setup(keys, argv)
  PL = nil
  if argv then
    BAND_SPAN, SCAN, BACKFILL_SCAN = tonumber(argv[1]), tonumber(argv[2]), tonumber(argv[3])
    UNIT, PER_SLOT, MIN_QUEUE = tonumber(argv[4]), tonumber(argv[5]), tonumber(argv[6])
    local n = #argv
    for i = 1, n - N_POLICY do argv[i] = argv[i + N_POLICY] end
    for i = math.max(n - N_POLICY + 1, 1), n do argv[i] = nil end
  end
  if P == keys[1] then return end
  P = keys[1]
  K_POOLS, K_ACTIVE, K_LINE, K_TICKETS = P..'pools', P..'active', P..'line', P..'tickets'
  K_SEQ, K_GRANTED, K_HOLD, K_REPLICAS = P..'seq', P..'granted', P..'hold', P..'replicas'
  K_TOKENS, K_FAIR, K_TACTIVE, K_TQUEUED = P..'tokens', P..'fair', P..'tactive', P..'tqueued'
  K_KEPT, K_GIVEN_UP = P..'kept', P..'given_up'
end
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
    if floor < 0 then floor = MIN_QUEUE end
    return math.max(PER_SLOT * fleet_cap, floor)
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
