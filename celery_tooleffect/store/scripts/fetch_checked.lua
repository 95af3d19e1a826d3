-- Take a queued item off its list, recorded unacknowledged as the worker
-- says, in one atomic step: the second step of the atomic fetch for an item
-- fetch.lua could not read as a kombu envelope and left queued (see
-- celery_tooleffect.worker.transport). The worker reads it with Python's json:
-- an envelope after all (cjson refuses lone surrogates, which Python's json
-- reads) is recorded under its own tag as kombu records it; anything else as
-- the envelope the worker wraps it in.
--
-- The item is taken only if it is still the list's next one: another consumer
-- may have taken it since fetch.lua read it. It is compared by its SHA-1, so
-- that its bytes (any size) are not sent back.
--
-- KEYS[1]   kombu's unacked hash
-- KEYS[2]   kombu's unacked_index sorted set
-- KEYS[3]   the list (global_keyprefix applied)
-- ARGV[1]   now: the score QoS.append gives
-- ARGV[2]   the delivery tag to record it under
-- ARGV[3]   the record: kombu's [envelope, exchange, routing key], as JSON
-- ARGV[4]   the SHA-1 (hex) of the item
--
-- Returns 1 when the item was recorded and popped, 0 when the list's next
-- item is another one (or none). Written in fetch.lua's order: recorded, then
-- popped (a write refused half-way leaves it queued).

local item = redis.call('LINDEX', KEYS[3], -1)
if not item or redis.sha1hex(item) ~= ARGV[4] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
redis.call('RPOP', KEYS[3])
return 1
