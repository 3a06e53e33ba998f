-- RETUNE: one function of the library app/replicas/lua/__init__.py makes; its ARGV
-- follow POLICY's.
-- ARGV: tenant, share, max_active (-1: none), eps -> 'ok' (its limits reloaded: its waiters
-- take them, so that a raised max_active lets them run on free slots at once)
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
