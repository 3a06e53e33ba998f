-- HEARTBEAT: one function of the library app/replicas/lua/__init__.py makes; its ARGV
-- follow POLICY's.
-- ARGV: replica, ttl_ms, eps, kept_ms -> {'ok', figures..., then upstream, budget of each
-- budgeted one} | {'fenced'}
local me, ttl = ARGV[1], tonumber(ARGV[2])
if redis.call('EXISTS', hb_key(me)) == 0 then return {'fenced'} end
local now = now_ms()
lease(me, ttl, tonumber(ARGV[4]), now)
if reap(now) > 0 then dispatch(tonumber(ARGV[3])) end
local out = {'ok', unpack(figures())}
-- The budgets one replica learned (a 500 from a shared cache), for the others to learn too.
for u, b in pairs(pools().bud) do out[#out + 1] = u; out[#out + 1] = tostring(b) end
return out
