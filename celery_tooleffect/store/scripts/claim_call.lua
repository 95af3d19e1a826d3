-- Claim a task id for one call at publish time: the first claim binds the id
-- to its tool and the digest of its arguments; a later claim of the same id
-- is the same call only with the same tool and digest.
--
-- KEYS[1] the task id's claim (a hash)
-- ARGV[1] the tool's name   ARGV[2] the digest of the arguments
-- ARGV[3] ttl seconds (the journal's retention)
--
-- Returns {'claimed'} (first claim), {'same'} (the same call, published
-- again), or {'conflict', 'tool' | 'arguments', the tool the id belongs to};
-- a conflict changes nothing.

local recorded = redis.call('HMGET', KEYS[1], 'tool', 'call_digest')
if not recorded[1] then
  redis.call('HSET', KEYS[1], 'tool', ARGV[1], 'call_digest', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {'claimed'}
end
if recorded[1] ~= ARGV[1] then
  return {'conflict', 'tool', recorded[1]}
end
if recorded[2] ~= ARGV[2] then
  return {'conflict', 'arguments', recorded[1]}
end
return {'same'}
