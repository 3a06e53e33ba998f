-- RELEASE: one function of the library app/replicas/lua/__init__.py makes; its ARGV
-- follow POLICY's.
-- ARGV: replica, member, hold_s ('' = not observed), eps, ewma alpha
-- -> 'released' | 'left' | 'none'
-- A release and a leave are one script: a waiter that gives up just as its grant is published
-- finds itself granted, and returns the slots.
local what, t = drop(ARGV[1], ARGV[2])
if what == 'released' and ARGV[3] ~= '' then
  local h = tonumber(ARGV[3])
  local old = tonumber(redis.call('GET', K_HOLD) or '-1')
  if old <= 0 then old = h end
  redis.call('SET', K_HOLD, tostring(old + tonumber(ARGV[5]) * (h - old)))
  -- The tenant pays for the slot time it held (in average holds), not for the one average
  -- hold it was charged.
  if old > 0 then fair_correct(t, t.charge * (h / old - 1)) end
end
if what ~= 'none' then dispatch(tonumber(ARGV[4])) end
return what
