-- Take one dead letter out of the store, atomically, if it is still the one
-- the caller read: delete it (purge) or move it aside while it is replayed.
--
-- KEYS[1] the queue's envelopes hash   KEYS[2] task id -> queue hash
-- KEYS[3] replays in progress hash     KEYS[4] joint counts hash
-- KEYS[5] set of queues                KEYS[6] set of facet:value pairs
-- KEYS[7] the queue's index            KEYS[8] the index of all queues
-- KEYS[9..] its facet indexes
-- ARGV[1] task id   ARGV[2] the envelope as read (JSON)
-- ARGV[3] 'move' (to KEYS[3]) or 'delete'   ARGV[4] the letter's queue
-- ARGV[5] now (unix seconds): a moved letter is kept as '<now>\n<envelope>'
-- ARGV[6] the letter's field in KEYS[4] (as dead_letter_store.lua wrote it)
-- ARGV[7..] the facet:value pair of each of KEYS[9..], in that order
--
-- A queue or facet:value whose index is left empty leaves its set too, so a
-- store whose letters were all replayed or purged keeps no trace of them
-- (the hashes and indexes are deleted by Redis when they are left empty).
--
-- The count of ARGV[6] goes down by one and its field is deleted at 0. It
-- never goes below 0: a letter stored before the counts existed (so never
-- counted) takes nothing from a count that is already 0.
--
-- Returns 1 when taken; 0 when the letter is gone or changed since it was
-- read (another operator took it, or a late outcome was copied onto it).

local envelopes, where, replaying, counts = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local task_id, expected, mode, queue = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local counted = ARGV[6]

local current = redis.call('HGET', envelopes, task_id)
if current ~= expected then
  return 0
end
redis.call('HDEL', envelopes, task_id)
for i = 7, #KEYS do
  redis.call('ZREM', KEYS[i], task_id)
end
if redis.call('ZCARD', KEYS[7]) == 0 then
  redis.call('SREM', KEYS[5], queue)
end
for i = 9, #KEYS do
  if redis.call('ZCARD', KEYS[i]) == 0 then
    redis.call('SREM', KEYS[6], ARGV[i - 2])
  end
end
local left = tonumber(redis.call('HGET', counts, counted) or '0') or 0
if left > 1 then
  redis.call('HINCRBY', counts, counted, -1)
else
  redis.call('HDEL', counts, counted)
end
if redis.call('HGET', where, task_id) == queue then
  redis.call('HDEL', where, task_id)
end
if mode == 'move' then
  redis.call('HSET', replaying, task_id, ARGV[5] .. '\n' .. current)
end
return 1
