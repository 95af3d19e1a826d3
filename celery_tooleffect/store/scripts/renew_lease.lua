-- Renew the journal's lease of a running attempt, if the caller still owns it.
--
-- KEYS[1] journal hash
-- ARGV[1] owner token, ARGV[2] new lease end (unix seconds)
-- Returns 1 when renewed, 0 when the attempt is no longer the caller's.

local current = redis.call('HMGET', KEYS[1], 'state', 'owner', 'lease_end')
if current[1] ~= 'running' or current[2] ~= ARGV[1] then
  return 0
end
if tonumber(ARGV[2]) > tonumber(current[3] or '0') then
  redis.call('HSET', KEYS[1], 'lease_end', ARGV[2])
end
return 1
