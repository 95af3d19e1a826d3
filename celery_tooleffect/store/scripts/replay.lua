-- Reset a task's journal entry for a replay, under a new attempt token, and
-- append the 'replayed' audit event with it, atomically.
--
-- KEYS[1] journal hash, KEYS[2] run events (a list, prelude.lua)
-- ARGV[1] new owner token     ARGV[2] now (unix seconds)
-- ARGV[3] states a replay may start from, space separated ('absent' = no entry)
-- ARGV[4] effect              ARGV[5] ttl seconds      ARGV[6] run events kept
-- ARGV[7] task id
-- ARGV[8] '1': refuse when the run's events hold a late_outcome of this task
-- ARGV[9] '1': a 'running' entry whose lease has lapsed may be replayed too
-- ARGV[10..] event field/value pairs
--
-- Returns {'ok', previous state, attempts spent before the replay}, or
-- {'refused', current state, detail} (detail: the late outcome's status).
--
-- The entry becomes state 'replayed' with attempt 0, so the replayed task has
-- its whole attempt budget again; begin_attempt treats 'replayed' as a new
-- start. The new owner token fences any worker of an earlier attempt.

local journal, events = KEYS[1], KEYS[2]
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

-- An event's fields that matter here, each one a script added ('+name') in
-- place of the one sent (an outcome that leaves out its task_id has the one
-- of the event before it, see prelude.lua).
local function fields_of(element)
  local found, added = {}, {}
  for _, pair in ipairs(event_items(element)) do
    local name, by_script = read_name(pair[1])
    if by_script then
      added[name] = pair[2]
    else
      found[name] = pair[2]
    end
  end
  for name, value in pairs(added) do found[name] = value end
  return found
end

if refuse_late then
  local task = nil
  for _, element in ipairs(redis.call('LRANGE', events, 1, -1)) do
    -- Only an event that names a late outcome is read field by field (and
    -- the task of the one before it, whose task_id it may leave out).
    if string.find(element, 'late_outcome', 17, true) then
      local event = fields_of(element)
      if (event['task_id'] or task) == task_id and event['phase'] == 'late_outcome' then
        return {'refused', 'late_outcome', event['status'] or ''}
      end
    end
    -- A full event names its task first (after the two sums), as 't'.
    if string.sub(element, 17, 19) == '1:t' then
      local colon = string.find(element, ':', 20, true)
      task = string.sub(element, colon + 1, colon + tonumber(string.sub(element, 20, colon - 1)))
    end
  end
end

redis.call('HSET', journal, 'state', 'replayed', 'attempt', 0, 'owner', token,
  'lease_end', 0, 'effect', effect, 'updated_at', now, 'replayed_at', now,
  'attempts_before_replay', attempts)
redis.call('HINCRBY', journal, 'replays', 1)
redis.call('EXPIRE', journal, ttl)
append_event(events, maxlen, ttl, fields,
  {previous_state = state, attempts_before = attempts})
return {'ok', state, attempts}
