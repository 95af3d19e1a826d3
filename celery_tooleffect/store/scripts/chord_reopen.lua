-- Look at, or reopen, the chord a dead-lettered member belongs to, in Celery's
-- Redis result backend (celery/backends/redis.py, CHORD_PART_RETURN_LUA).
--
-- KEYS[1] the chord's join set ('.j')     KEYS[2] its size ('.s')
-- KEYS[3] members recorded ('.d')         KEYS[4] callback claim / done marker ('.c')
-- ARGV[1] the member as recorded: '<task id>:<group index>' ('+inf' without one)
-- ARGV[2] its score in the join set (the group index, or '+inf')
-- ARGV[3] 'check' to look only, 'reopen' to forget the member's recorded result
--
-- Returns 'closed' (the chord's callback was claimed or dispatched, or its
-- size is gone: it ended), 'open', or 'reopened'.
--
-- Celery records a member's result once ('.d' keeps "task id:index"), so a
-- replayed member's result would be ignored while its failure stays in the
-- join set. Reopening removes both, while the chord still waits: then the
-- replay's result is recorded as if it were the first, and the callback runs
-- once, when every member has returned.

local join, size, recorded, claim = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local member, score, mode = ARGV[1], ARGV[2], ARGV[3]

if redis.call('EXISTS', size) == 0 or redis.call('EXISTS', claim) == 1 then
    return 'closed'
end
if mode ~= 'reopen' then
    return 'open'
end
if redis.call('SREM', recorded, member) == 1 then
    redis.call('ZREMRANGEBYSCORE', join, score, score)
end
return 'reopened'
