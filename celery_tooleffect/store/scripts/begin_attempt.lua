-- Decide whether this delivery of a write may run its body, and if so record
-- the intent (journal to 'running' under the caller's owner token) together
-- with its audit event.
--
-- KEYS[1] journal hash, KEYS[2] run events (a list, prelude.lua)
-- KEYS[3], KEYS[4] (optional, when the broker is on this Redis server, in
--         this database or another: ARGV[15]) kombu's unacked_mutex and
--         unacked_index: the message's broker lease is secured with the
--         intent, as extend_lease.lua does, and no intent is recorded when it
--         cannot be
-- KEYS[#KEYS - 1], KEYS[#KEYS] (when ARGV[13] is not ''; not on a cluster)
--         the calling process's writer key and the store's rollback mark
--         (store/rollback.py)
-- ARGV[1] owner token        ARGV[2] now (unix seconds, float)
-- ARGV[3] lease end          ARGV[4] effect
-- ARGV[5] attempts allowed   ARGV[6] ttl seconds
-- ARGV[7] run events kept (maxlen)
-- ARGV[8] '1' when the tool reconciled an interrupted attempt and found its
--         write not applied: a non-idempotent write may then start again
-- ARGV[9] with KEYS[3..4]: the message's delivery tag ('' without)
-- ARGV[10] with KEYS[3..4]: its new unacked_index score ('' without)
-- ARGV[11] the tool's name    ARGV[12] the digest of the call's arguments
-- ARGV[13] the count of intents this store last acknowledged to the calling
--          process ('' when not watched for rollbacks)
-- ARGV[14] when the message was published ('' when it does not say; 'first'
--          when its broker never delivered it before, so it cannot have run)
-- ARGV[15] with KEYS[3..4] in another database than the store's (one server,
--          several databases): prelude.lua's databases argument, whose
--          broker database the lease is secured in; '' otherwise
-- ARGV[16..] event field/value pairs
--
-- A call is bound to its tool and arguments: the first intent records both,
-- and a delivery of the same task id under another tool, or with other
-- arguments, is a conflict (nothing is changed). The effect the entry
-- records wins when it is stricter than ARGV[4] (a worker of an older
-- release declaring less), and the stricter one is recorded.
--
-- A rollback of the store (store/rollback.py): the writer key holding less
-- than ARGV[13] means the store lost an intent it acknowledged; the rollback
-- mark then records when that was found. A non-idempotent write with no entry
-- whose message was published before the mark's time may have run before the
-- rollback: it is recorded interrupted ('store_rolled_back'), never started.
--
-- Returns {verdict, attempt, detail, effect, count, rolled_back, ...},
-- effect being the one the delivery is handled under, count the calling
-- process's writer count after this call ('' when not watched or unchanged),
-- rolled_back '1' when this call found the store rolled back:
--   started         the body may run (detail: 'new', 'reclaimed' or
--                   'reconciled'), then also
--                   the attempt's fencing token: the entry's 'fence' counter,
--                   raised by one for each attempt started and never reset
--                   (a replay keeps it), recorded in the intent event
--   conflict        the task id is another call's (detail: 'tool' or
--                   'arguments'), then also the tool recorded for it
--   done            the outcome is recorded already: acknowledge, do not run
--                   (then also the result and its content type, when an
--                   interactive call kept them: a tool called in a tool)
--   dead_lettered   the task is a dead letter already: acknowledge, do not run
--   dead_lettering  a dead letter was begun and not finished (detail: reason)
--   owned           a live owner runs it (detail: its lease end)
--   interrupted     a non-idempotent write started and never finished
--                   (detail 'failed': an interactive one raised, not
--                   marked NoSideEffect; 'store_rolled_back': its entry may
--                   have been lost with a rollback of the store)
--   not_run         it ended without running (revoked or expired): do not run
--   exhausted       the attempt budget is spent (then also: how many earlier
--                   attempts failed, were interrupted, asked for a retry)
--   lease_busy      (broker lease) a restore sweep holds kombu's mutex: try
--                   again shortly; nothing recorded
--   lease_lost      (broker lease) the message was restored or acknowledged:
--                   its other copy runs; nothing recorded

local journal, events = KEYS[1], KEYS[2]
local token, now, lease_end = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local effect, allowed, ttl, maxlen = ARGV[4], tonumber(ARGV[5]), ARGV[6], ARGV[7]
local resume = ARGV[8] == '1'
local tool, digest = ARGV[11], ARGV[12]
local watched, sent_at, first = ARGV[13] ~= '', tonumber(ARGV[14]), ARGV[14] == 'first'
local dbs = databases(ARGV[15])
local fields = slice(ARGV, 16, #ARGV)
local leased = #KEYS - (watched and 2 or 0) >= 4

-- The rollback watch: the store holding a smaller count than it acknowledged.
local count, rolled_back, writer, mark = '', '0', nil, nil
if watched then
  writer, mark = KEYS[#KEYS - 1], KEYS[#KEYS]
  local kept = tonumber(redis.call('GET', writer) or '0')
  if kept < tonumber(ARGV[13]) then
    rolled_back = '1'
    redis.call('HSET', mark, 'detected_at', ARGV[2], 'writer', writer,
      'acknowledged', ARGV[13], 'found', tostring(kept))
    redis.call('EXPIRE', mark, ttl)
    -- Found once: the key holds the count again, so that the next call of
    -- this process does not find the same rollback (and move the mark on).
    redis.call('SET', writer, ARGV[13], 'EX', 4 * tonumber(ttl))
  end
end

local function reply(verdict, attempt_now, detail_now, ...)
  return {verdict, attempt_now, detail_now, effect, count, rolled_back, ...}
end

local current = redis.call('HMGET', journal, 'state', 'attempt', 'owner', 'lease_end', 'reason',
  'fence', 'tool', 'call_digest', 'effect', 'interrupted_by')
local state, attempt, owner = current[1], tonumber(current[2] or '0'), current[3]
local owner_lease_end, pending_reason = tonumber(current[4] or '0'), current[5]

-- The strictest effect wins (an unknown name counts as the strictest).
local strictness = {read_only = 0, idempotent_write = 1, non_idempotent_write = 2}
local recorded_effect = current[9]
if recorded_effect and (strictness[recorded_effect] or 2) > (strictness[effect] or 2) then
  effect = recorded_effect
end

-- The same task id for another call: refused before anything else, changing nothing.
if current[7] and current[7] ~= tool then
  return reply('conflict', attempt, 'tool', current[7])
end
if current[8] and digest ~= '' and current[8] ~= digest then
  return reply('conflict', attempt, 'arguments', current[7] or tool)
end

-- A re-sent begin of the attempt we already own (a reconnect retried it).
if state == 'running' and owner == token then
  return reply('started', attempt, 'same', current[6] or '0')
end

-- The broker lease of a write with a deadline, before anything else is
-- decided, as a separate extension before this script would do
-- (extend_lease.lua, inlined: one round trip less when the broker is on
-- this Redis server, in its own database if it has one); a refused lease
-- decides nothing and records nothing.
if leased then
  local refused = in_database(dbs, 'broker', function()
    if redis.call('EXISTS', KEYS[3]) == 1 then
      return 'busy'
    end
    if not redis.call('ZSCORE', KEYS[4], ARGV[9]) then
      return 'lost'
    end
    redis.call('ZADD', KEYS[4], 'XX', 'GT', ARGV[10], ARGV[9])
    return nil
  end)
  if refused == 'busy' then
    return reply('lease_busy', attempt, '')
  end
  if refused == 'lost' then
    return reply('lease_lost', attempt, '')
  end
end

if state == 'succeeded' then
  append_event(events, maxlen, ttl, fields,
    {phase = 'duplicate_ignored', status = 'succeeded', attempt = attempt})
  local kept = redis.call('HMGET', journal, 'result', 'result_type')
  return reply('done', attempt, '', kept[1] or '', kept[2] or '')
end
if state == 'dead_lettered' then
  append_event(events, maxlen, ttl, fields,
    {phase = 'duplicate_ignored', status = 'dead_lettered', attempt = attempt})
  return reply('dead_lettered', attempt, '')
end
if state == 'not_run' then
  append_event(events, maxlen, ttl, fields,
    {phase = 'duplicate_ignored', status = 'not_run', attempt = attempt})
  return reply('not_run', attempt, '')
end
if state == 'dead_lettering' then
  return reply('dead_lettering', attempt, pending_reason or '')
end

local detail = 'new'
if state == 'running' then
  if owner_lease_end > now then
    return reply('owned', attempt, tostring(owner_lease_end))
  end
  -- The owner's lease lapsed without an outcome: its worker is gone.
  state = 'interrupted'
  redis.call('HSET', journal, 'state', state, 'updated_at', ARGV[2])
  redis.call('HINCRBY', journal, 'ended_interrupted', 1)
  redis.call('EXPIRE', journal, ttl)
  append_event(events, maxlen, ttl, fields,
    {phase = 'interrupted', status = 'lease_lapsed', attempt = attempt})
  if effect == 'non_idempotent_write' and not resume then
    return reply('interrupted', attempt, 'lease_lapsed')
  end
  detail = resume and 'reconciled' or 'reclaimed'
elseif state == 'interrupted' then
  if effect == 'non_idempotent_write' and not resume then
    return reply('interrupted', attempt, current[10] or 'interrupted')
  end
  detail = resume and 'reconciled' or 'reclaimed'
elseif state == 'failed' and effect == 'non_idempotent_write' and not resume
    and redis.call('HGET', journal, 'no_side_effect') == '0' then
  -- An interactive non-idempotent write that raised may have written (a tool
  -- called in a tool's body, its parent now running again): never again.
  return reply('interrupted', attempt, 'failed')
elseif not state and watched and effect == 'non_idempotent_write' and not resume
    and not first then
  -- No entry: a new call, or one whose entry a rollback of the store lost.
  local detected = tonumber(redis.call('HGET', mark, 'detected_at') or '0')
  if detected > 0 and (sent_at == nil or sent_at < detected) then
    redis.call('HSET', journal, 'state', 'interrupted', 'attempt', 0, 'effect', effect,
      'tool', tool, 'updated_at', ARGV[2], 'interrupted_by', 'store_rolled_back')
    if digest ~= '' then
      redis.call('HSET', journal, 'call_digest', digest)
    end
    redis.call('EXPIRE', journal, ttl)
    append_event(events, maxlen, ttl, fields,
      {phase = 'interrupted', status = 'store_rolled_back', attempt = 0,
       rollback_detected_at = tostring(detected)})
    return reply('interrupted', 0, 'store_rolled_back')
  end
end

if attempt >= allowed then
  local ended = redis.call('HMGET', journal, 'ended_failed', 'ended_interrupted',
    'ended_requested')
  return reply('exhausted', attempt, detail, ended[1] or '0', ended[2] or '0', ended[3] or '0')
end

attempt = attempt + 1
-- The fence read above, raised: the script runs alone, so this is HINCRBY's
-- answer, written with the rest of the intent in one command.
local fence = tonumber(current[6] or '0') + 1
local intent = {'state', 'running', 'attempt', attempt, 'owner', token, 'lease_end', lease_end,
  'effect', effect, 'updated_at', ARGV[2], 'tool', tool, 'fence', fence}
if digest ~= '' then
  intent[#intent + 1] = 'call_digest'
  intent[#intent + 1] = digest
end
redis.call('HSET', journal, unpack(intent))
if current[10] then
  redis.call('HDEL', journal, 'interrupted_by')
end
redis.call('EXPIRE', journal, ttl)
append_event(events, maxlen, ttl, fields,
  {phase = 'intent', status = 'started', attempt = attempt, reclaimed = detail,
   fencing_token = fence, effect = effect})
if watched then
  -- One more intent acknowledged to this process. The key outlives the
  -- journal (4 x its ttl): a process idle for longer reads as rolled back.
  local acknowledged = math.max(tonumber(redis.call('GET', writer) or '0'),
    tonumber(ARGV[13])) + 1
  redis.call('SET', writer, acknowledged, 'EX', 4 * tonumber(ttl))
  count = tostring(acknowledged)
end
return reply('started', attempt, detail, tostring(fence))
