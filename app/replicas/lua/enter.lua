-- ENTER: one function of the library app/replicas/lua/__init__.py makes; its ARGV
-- follow POLICY's.
-- ARGV: replica, ticket id, weight, cost, ranking, eps, band, tag ('' = computed: the fair
-- start tag for a tenant, else the arrival number), max_queue, queue_per_slot, min_queue (-1:
-- not set), tenant ('' = none), share, max_active, max_queued (-1: none), tasks (a prompt
-- array's, else 0: see `weighs`; weight is then its least).
-- -> {'grant', member, upstream, reason, grant number, slots held}
--    | {'queued', member, position, limit, grants so far}
--    | {'full', limit, figures...} | {'tenant_full', tenant queued, tenant active, figures...}
--    | {'unknown', figures...} | {'large', most slots it may have, figures...} | {'fenced'}
-- ('large': more than the largest upstream's slots, or than its tenant's max_active)
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
