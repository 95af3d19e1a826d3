-- Reset a task's journal entry for a replay, under a new attempt token, and
-- append the 'replayed' audit event with it, atomically.
--
-- KEYS[1] journal hash, KEYS[2] run stream, KEYS[3] run event counter
-- ARGV[1] new owner token     ARGV[2] now (unix seconds)
-- ARGV[3] states a replay may start from, space separated ('absent' = no entry)
-- ARGV[4] effect              ARGV[5] ttl seconds      ARGV[6] stream MAXLEN
-- ARGV[7] task id
-- ARGV[8] '1': refuse when the run's stream holds a late_outcome of this task
-- ARGV[9] '1': a 'running' entry whose lease has lapsed may be replayed too
-- ARGV[10..] event field/value pairs
--
-- Returns {'ok', previous state, attempts spent before the replay}, or
-- {'refused', current state, detail} (detail: the late outcome's status).
--
-- The entry becomes state 'replayed' with attempt 0, so the replayed task has
-- its whole attempt budget again; begin_attempt treats 'replayed' as a new
-- start. The new owner token fences any worker of an earlier attempt.

local journal, stream, seq = KEYS[1], KEYS[2], KEYS[3]
local token, now, allowed = ARGV[1], ARGV[2], ARGV[3]
local effect, ttl, maxlen, task_id = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local refuse_late, lapsed_ok = ARGV[8] == '1', ARGV[9] == '1'
local fields = slice(ARGV, 10, #ARGV)

local current = redis.call('HMGET', journal, 'state', 'attempt', 'lease_end')
local state = current[1] or 'absent'
local attempts = current[2] or '0'

local ok = false
for name in string.gmatch(allowed, '%S+') do
  if name == state then ok = true end
end
if not ok and state == 'running' and lapsed_ok
    and tonumber(current[3] or '0') < tonumber(now) then
  ok = true
end
if not ok then
  return {'refused', state, ''}
end

if refuse_late then
  for _, entry in ipairs(redis.call('XRANGE', stream, '-', '+')) do
    local data, is_task, is_late, status = entry[2], false, false, ''
    for i = 1, #data, 2 do
      if data[i] == 'task_id' and data[i + 1] == task_id then is_task = true end
      if data[i] == 'phase' and data[i + 1] == 'late_outcome' then is_late = true end
      if data[i] == 'status' then status = data[i + 1] end
    end
    if is_task and is_late then
      return {'refused', 'late_outcome', status}
    end
  end
end

redis.call('HSET', journal, 'state', 'replayed', 'attempt', 0, 'owner', token,
  'lease_end', 0, 'effect', effect, 'updated_at', now, 'replayed_at', now,
  'attempts_before_replay', attempts)
redis.call('HINCRBY', journal, 'replays', 1)
redis.call('EXPIRE', journal, ttl)
append_event(stream, seq, maxlen, ttl, fields,
  {previous_state = state, attempts_before = attempts})
return {'ok', state, attempts}
