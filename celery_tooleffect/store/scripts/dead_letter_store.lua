-- Store one dead letter and index it, atomically; the first one stored wins.
--
-- KEYS[1] the queue's envelopes hash   KEYS[2] the queue's index (by time)
-- KEYS[3] set of queues                KEYS[4] task id -> queue hash
-- KEYS[5] set of facet:value pairs     KEYS[6] joint counts hash
-- KEYS[7..] the other indexes (by time)
-- ARGV[1] task id   ARGV[2] envelope (JSON)   ARGV[3] time stored (score)
-- ARGV[4] queue     ARGV[5] the letter's field in KEYS[6] (JSON array of its
--                   queue, reason, failure class and effect)
-- ARGV[6..] facet:value pairs
--
-- Returns 1 when stored now, 0 when the task already was a dead letter (then
-- nothing changes: its first envelope, reason and index entries stay).

local task_id, envelope, score, queue = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if redis.call('HSETNX', KEYS[1], task_id, envelope) == 0 then
  return 0
end
redis.call('ZADD', KEYS[2], 'NX', score, task_id)
redis.call('SADD', KEYS[3], queue)
redis.call('HSETNX', KEYS[4], task_id, queue)
redis.call('HINCRBY', KEYS[6], ARGV[5], 1)
for i = 6, #ARGV do
  redis.call('SADD', KEYS[5], ARGV[i])
end
for i = 7, #KEYS do
  redis.call('ZADD', KEYS[i], 'NX', score, task_id)
end
return 1
