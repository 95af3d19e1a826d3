-- Park a call that needs approval: write its record and the 'approval
-- requested' audit event, atomically; the first record stored wins.
--
-- The same script stores a decision the agent's user took before the call
-- was published (a record without a message, in its decided state), and
-- lets a record in the 'adopt' state that has no message yet take this
-- delivery's (a call its user approved, now waiting for an operator).
--
-- KEYS[1] approval hash   KEYS[2] run events (a list, prelude.lua)
-- ARGV[1] ttl seconds     ARGV[2] run events kept (maxlen)
-- ARGV[3] the state whose record without a message adopts this one ('' none)
-- ARGV[4] n: how many record field/value pairs follow
-- ARGV[5 .. 4+2n] record field/value pairs (with its state)
-- ARGV[5+2n ..] event field/value pairs
--
-- Returns {'ok'} when stored now, {'adopted', current state} when an
-- existing record took the message (its state and decision unchanged), or
-- {'exists', current state} when the call already has a record (a
-- redelivery of a parked or decided call): then nothing changes.

local approval, events = KEYS[1], KEYS[2]
local ttl, maxlen, adopt = ARGV[1], ARGV[2], ARGV[3]
local n = tonumber(ARGV[4])
local record_fields = slice(ARGV, 5, 4 + 2 * n)
local event_fields = slice(ARGV, 5 + 2 * n, #ARGV)

local current = redis.call('HGET', approval, 'state')
if current then
  if current ~= adopt or redis.call('HEXISTS', approval, 'message') == 1 then
    return {'exists', current}
  end
  for i = 1, #record_fields, 2 do
    if record_fields[i] ~= 'state' then
      redis.call('HSETNX', approval, record_fields[i], record_fields[i + 1])
    end
  end
  redis.call('EXPIRE', approval, ttl)
  append_event(events, maxlen, ttl, event_fields, {})
  return {'adopted', current}
end
redis.call('HSET', approval, unpack(record_fields))
redis.call('EXPIRE', approval, ttl)
append_event(events, maxlen, ttl, event_fields, {})
return {'ok'}
