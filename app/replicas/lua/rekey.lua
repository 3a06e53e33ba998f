-- REKEY: one function of the library app/replicas/lua/__init__.py makes; its ARGV
-- follow POLICY's.
-- ARGV: replica, old upstream, new upstream -> 'ok'
-- An upstream known by another name now (an address of its name, upstreams/fleet.py): the old name
-- leaves the pools, and the replica's grants there move to the new one, their slots and tokens
-- with them, so that its running requests still count against its slots.
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
