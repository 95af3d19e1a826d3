-- Extend the lease of one message on kombu's Redis transport.
--
-- kombu restores a message when its score in the unacked index is older than
-- now - visibility_timeout, so a lease that must last until T is the score
-- T - visibility_timeout. The score only ever grows (ZADD XX GT).
--
-- KEYS[1] kombu's unacked_mutex, KEYS[2] kombu's unacked_index
-- ARGV[1] delivery tag, ARGV[2] new score
-- Returns 'BUSY' while a restore sweep holds the mutex (try again shortly),
-- 'LOST' when the tag has no score any more (the message was restored or
-- acknowledged), else 'OK'.

if redis.call('EXISTS', KEYS[1]) == 1 then
  return 'BUSY'
end
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return 'LOST'
end
redis.call('ZADD', KEYS[2], 'XX', 'GT', ARGV[2], ARGV[1])
return 'OK'
