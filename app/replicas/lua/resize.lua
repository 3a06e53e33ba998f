-- RESIZE: one function of the library app/replicas/lua/__init__.py makes; its ARGV
-- follow POLICY's.
-- ARGV: upstream, capacity ('' = unknown), eps, budget in tokens ('' = it does not bind; '?' =
-- none learned here, another replica's for the same slot count stays) -> 'ok'
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
