-- Park a call that needs approval: write its record and the 'approval
-- requested' audit event, atomically; the first record stored wins.
--
-- KEYS[1] approval hash   KEYS[2] run stream   KEYS[3] run event counter
-- ARGV[1] ttl seconds     ARGV[2] stream MAXLEN
-- ARGV[3] n: how many record field/value pairs follow
-- ARGV[4 .. 3+2n] record field/value pairs (with state 'pending')
-- ARGV[4+2n ..] event field/value pairs
--
-- Returns {'ok'} when parked now, or {'exists', current state} when the call
-- already has a record (a redelivery of a parked or decided call): then
-- nothing changes.

local approval, stream, seq = KEYS[1], KEYS[2], KEYS[3]
local ttl, maxlen = ARGV[1], ARGV[2]
local n = tonumber(ARGV[3])
local record_fields = slice(ARGV, 4, 3 + 2 * n)
local event_fields = slice(ARGV, 4 + 2 * n, #ARGV)

local current = redis.call('HGET', approval, 'state')
if current then
  return {'exists', current}
end
redis.call('HSET', approval, unpack(record_fields))
redis.call('EXPIRE', approval, ttl)
append_event(stream, seq, maxlen, ttl, event_fields, {})
return {'ok'}
