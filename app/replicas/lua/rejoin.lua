-- REJOIN: one function of the library app/replicas/lua/__init__.py makes; its ARGV
-- follow POLICY's.
-- ARGV: replica, ttl_ms, eps, kept_ms, n_pools, n_grants, n_waiters, then the pools
-- (upstream, capacity, budget or '': none learned here, another's stays), the grants
-- (member, upstream, slots held, least, tasks, cost, band, tenant, share, max_active,
-- ranking) and the waiters in order (id, least, tasks, cost, ranking, band, tag, tenant,
-- share, max_active).
-- -> {figures..., new member of each waiter in order...}
--
-- Replaces whatever Redis holds for the replica with what the replica says it holds: after it
-- was given up, after Redis restarted empty, or after Redis was slow and may have run commands
-- whose answers the replica never read. A grant registered again keeps the charge it had (its
-- release corrects nothing); its waiters get new tags.
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
