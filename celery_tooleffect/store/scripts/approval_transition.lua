-- Move an approval record from one of the allowed states to a new one, with
-- its audit event, atomically (a decision, or a worker ending a refused call).
--
-- KEYS[1] approval hash   KEYS[2] run events (a list, prelude.lua)
-- ARGV[1] allowed states, space separated   ARGV[2] new state
-- ARGV[3] ttl seconds     ARGV[4] run events kept (maxlen)
-- ARGV[5] n: how many record field/value pairs follow
-- ARGV[6 .. 5+2n] record field/value pairs to set (who, when, why)
-- ARGV[6+2n ..] event field/value pairs
--
-- Returns {'ok', previous state}, or {'refused', current state} (then nothing
-- changes: a second decision is refused here).

local approval, events = KEYS[1], KEYS[2]
local allowed, new_state, ttl, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local n = tonumber(ARGV[5])
local record_fields = slice(ARGV, 6, 5 + 2 * n)
local event_fields = slice(ARGV, 6 + 2 * n, #ARGV)

local current = redis.call('HGET', approval, 'state') or 'absent'
local permitted = false
for name in string.gmatch(allowed, '%S+') do
  if name == current then permitted = true end
end
if not permitted then
  return {'refused', current}
end
redis.call('HSET', approval, 'state', new_state)
if #record_fields > 0 then
  redis.call('HSET', approval, unpack(record_fields))
end
redis.call('EXPIRE', approval, ttl)
append_event(events, maxlen, ttl, event_fields, {})
return {'ok', current}
