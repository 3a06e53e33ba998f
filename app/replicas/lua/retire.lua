-- RETIRE: one function of the library app/replicas/lua/__init__.py makes; its ARGV
-- follow POLICY's.
-- ARGV: replica, eps -> 'ok' (a replica leaving for good: what it holds goes back at once)
unregister(ARGV[1])
redis.call('DEL', hb_key(ARGV[1]))
dispatch(tonumber(ARGV[2]))
return 'ok'
