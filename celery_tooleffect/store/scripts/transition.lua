-- Move a journal entry to a new state and append the matching audit event,
-- atomically. Fenced: only the owner of the attempt may move it, and only
-- from the states the caller allows. A caller that may not move it still has
-- its event stored, as phase 'late_outcome', so no outcome goes unrecorded.
--
-- KEYS[1] journal hash, KEYS[2] run events (a list, prelude.lua)
-- KEYS[3] (optional) Celery's result key of the task: when given and the
--         entry moves, the result is stored there and published on it, as
--         Celery's Redis backend does (SET/SETEX, then PUBLISH on the key)
-- ARGV[1] owner token ('' = any owner)
-- ARGV[2] allowed current states, space separated ('absent' = no entry yet)
-- ARGV[3] new state          ARGV[4] ttl seconds (the journal: none for
--                             'dead_lettered', which lasts as long as its letter)
-- ARGV[5] run events kept      ARGV[6] now (unix seconds)
-- ARGV[7] '1' to store the event as a late_outcome when refused, '0' not to
-- ARGV[8] a journal counter to increment when moved ('' = none): how many
--         attempts ended this way ('ended_failed', 'ended_requested', ...)
-- ARGV[9] N, the number of extra journal field/value pairs
-- ARGV[10] with KEYS[3]: the result's expiry in seconds ('0' = none)
-- ARGV[11] with KEYS[3]: the result, encoded by Celery's backend ('' without)
-- ARGV[12] the delivery tag of the task's message, to acknowledge when the
--          entry moves ('' = none); then the last two keys are kombu's unacked
--          hash and unacked_index (the broker is this Redis)
-- ARGV[13] the databases of the result and the message when either is not the
--          store's (prelude.lua, databases: '<store> <result> <broker>'), or ''
-- ARGV[14 .. 13+2N] journal field/value pairs, then event field/value pairs
--
-- Returns {'ok', previous state}, or {'late' | 'refused', current state, owner}.

local journal, events = KEYS[1], KEYS[2]
local token, allowed, new_state = ARGV[1], ARGV[2], ARGV[3]
local ttl, maxlen, now = ARGV[4], ARGV[5], ARGV[6]
local record_late = ARGV[7] == '1'
local counter = ARGV[8]
local n = tonumber(ARGV[9])
local ack_tag = ARGV[12]
local dbs = databases(ARGV[13])
local journal_fields = slice(ARGV, 14, 13 + 2 * n)
local event_fields = slice(ARGV, 14 + 2 * n, #ARGV)
local result_keys = #KEYS
if ack_tag ~= '' then result_keys = result_keys - 2 end

local current = redis.call('HMGET', journal, 'state', 'owner')
local state, owner = current[1] or 'absent', current[2] or ''

local state_allowed = false
for name in string.gmatch(allowed, '%S+') do
  if name == state then state_allowed = true end
end

if state_allowed and (token == '' or owner == token or state == 'absent') then
  journal_fields[#journal_fields + 1] = 'state'
  journal_fields[#journal_fields + 1] = new_state
  journal_fields[#journal_fields + 1] = 'updated_at'
  journal_fields[#journal_fields + 1] = now
  redis.call('HSET', journal, unpack(journal_fields))
  if counter ~= '' then
    redis.call('HINCRBY', journal, counter, 1)
  end
  if new_state == 'dead_lettered' then
    -- Kept as long as its dead letter (DESIGN §7): a replay sets the TTL
    -- again (replay.lua), a purge too (Journal.release). A copy of the
    -- message that comes back after the retention still finds the entry.
    redis.call('PERSIST', journal)
  else
    redis.call('EXPIRE', journal, ttl)
  end
  append_event(events, maxlen, ttl, event_fields, {})
  if result_keys >= 3 then
    store_result(KEYS[3], ARGV[11], tonumber(ARGV[10]), dbs)
  end
  if ack_tag ~= '' then
    ack_message(KEYS[#KEYS - 1], KEYS[#KEYS], ack_tag, dbs)
  end
  return {'ok', state}
end

if not record_late then
  return {'refused', state, owner}
end
local phase = ''
for i = 1, #event_fields, 2 do
  if event_fields[i] == 'phase' then phase = event_fields[i + 1] end
end
append_event(events, maxlen, ttl, event_fields,
  {phase = 'late_outcome', late_phase = phase, journal_state = state})
return {'late', state, owner}
