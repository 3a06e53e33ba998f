-- REROUTE: one function of the library app/replicas/lua/__init__.py makes; its ARGV
-- follow POLICY's.
-- ARGV: replica, member, eps -> 'queued' | 'none'
-- Its upstream did not take the request: the grant's slots go back and the ticket waits again
-- at the head of the line (a score under the head's and under its band's tags), for
-- whichever upstream has room first.
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
