-- QUOTA: one function of the library app/replicas/lua/__init__.py makes; its ARGV follow
-- POLICY's. A tenant's quota windows for the whole fleet: `check` and `charged` of
-- app/gate/quotas.py, whose docstring says the rule, in one script.
-- ARGV: tenant, requests_per_minute, tokens_per_minute, tokens_per_day (0: none), tokens
-- (-1: admit a request; else charge an ended answer's), now in seconds (empty: Redis's clock)
-- -> {'charged'} | {refused limit or '', retry_after_s, then the standing: limit_requests
-- ('' for none), remaining_requests, reset_requests_s, limit_tokens ('' for none),
-- remaining_tokens, reset_tokens_s}
local rpm, tpm, tpd = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, now = tonumber(ARGV[5]), tonumber(ARGV[6])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local key = P..'q:'..ARGV[1]
local a = redis.call('HMGET', key, 'm', 'r', 'mt', 'd', 'dt')
local m, r, mt = tonumber(a[1]) or 0, tonumber(a[2]) or 0, tonumber(a[3]) or 0
local d, dt = tonumber(a[4]) or 0, tonumber(a[5]) or 0
local minute, day = math.floor(now / 60), math.floor(now / 86400)
if m ~= minute then m, r, mt = minute, 0, 0 end
if d ~= day then d, dt = day, 0 end
local function save()
  redis.call('HSET', key, 'm', m, 'r', r, 'mt', mt, 'd', d, 'dt', dt)
  -- Gone a minute after its day ends: an idle tenant's windows take no memory.
  redis.call('PEXPIREAT', key, ((d + 1) * 86400 + 60) * 1000)
end
if tokens >= 0 then
  mt, dt = mt + tokens, dt + tokens
  save()
  return {'charged'}
end
local minute_left, day_left = (m + 1) * 60 - now, (d + 1) * 86400 - now
local refused, retry = '', 0
if rpm > 0 and r >= rpm then refused, retry = 'requests_per_minute', minute_left
elseif tpm > 0 and mt >= tpm then refused, retry = 'tokens_per_minute', minute_left
elseif tpd > 0 and dt >= tpd then refused, retry = 'tokens_per_day', day_left
else
  r = r + 1
  save()
end
local lr, rr, sr = '', 0, 0
if rpm > 0 then lr, rr, sr = rpm, math.max(rpm - r, 0), minute_left end
local lt, rt, st = '', 0, 0
if tpm > 0 then lt, rt, st = tpm, math.max(tpm - mt, 0), minute_left end
if tpd > 0 and (tpm <= 0 or tpd - dt < rt) then lt, rt, st = tpd, math.max(tpd - dt, 0), day_left end
return {refused, num(retry), tostring(lr), tostring(rr), num(sr), tostring(lt), tostring(rt),
  num(st)}
