-- Shared by every script of the package; prepended when a script is loaded.
--
-- append_event adds one audit event to a run's list and keeps the list alive
-- for the retention period. It runs inside the calling script, so an event and
-- the transition it records are stored together or not at all. The layout is
-- celery_tooleffect/store/chain.py's: element 0 is the run's header
-- 'te1 <seq> <head> <base_seq> <base>', each later element one event,
-- '<sum: 8 hex><link: 8 hex><body>', body the fields as sent (without run_id:
-- the key names the run; the writer's keyed 'mac' among them) then the
-- fields this script adds, named '+<name>', the common names stored as one
-- character ('codes' below), each name and value written
-- <byte length>:<bytes> (a write's outcome leaves out what its intent just
-- before it said: see 'inherited'; an added field equal to the one sent is
-- left out too). link = SHA-1(previous link .. body), computed here,
-- where the previous link is at hand (the worker would need a round trip to
-- learn it); sum = SHA-1(body). Editing, removing or moving an event breaks
-- the chain at that point (see AuditLog.verify).
--
-- A list, not a stream: Redis 7 allocates a stream's first node at
-- stream-node-max-bytes (4 kB) up front, most of what a call without a run of
-- its own would cost. Past maxlen (+ a tenth: trimmed in batches, as XADD's
-- MAXLEN ~), the oldest events are trimmed and the header's base moves on to
-- the link after the newest trimmed one, so that verifying starts there.
-- Returns {seq as text, seq}.

-- The one-character names the common fields are stored under (chain.py's
-- CODES). Any other name of one character, or starting with '=' or '+', is
-- stored after a '=': a stored name of one character is always a code.
local codes = {task_id = 't', tool = 'o', effect = 'e', phase = 'p', status = 's',
  worker = 'w', queue = 'q', redelivered = 'r', ts = 'T', attempt = 'a',
  duration_ms = 'd', failure_class = 'f', exception_type = 'x', args_size = 'A',
  kwargs_size = 'K', result_size = 'R', error_size = 'E', idempotency_key = 'i',
  fencing_token = 'F', reclaimed = 'c', mac = 'm', actor = 'y', reason = 'n',
  late_phase = 'L', journal_state = 'J', previous_state = 'P', attempts_before = 'B',
  lease_until = 'U', dead_letter_reason = 'D'}
-- The reverse of 'codes', made on first use: only read_name needs it, and
-- building it costs every script that includes this prelude about 3 us.
local names = nil

local function stored_name(name)
  local code = codes[name]
  if code then return code end
  local first = string.sub(name, 1, 1)
  if #name == 1 or first == '=' or first == '+' then return '=' .. name end
  return name
end

-- A stored name read back: (name, true when the storing script added it).
local function read_name(stored)
  local first = string.sub(stored, 1, 1)
  if first == '=' then return string.sub(stored, 2), false end
  if first == '+' then
    local name = read_name(string.sub(stored, 2))
    return name, true
  end
  if #stored == 1 then
    if names == nil then
      names = {}
      for name, code in pairs(codes) do names[code] = name end
    end
    return names[stored] or stored, false
  end
  return stored, false
end

-- The (stored name, value) pairs of an event's element, in stored order (the
-- first 'limit' of them when given).
local function event_items(element, limit)
  local items, at, name = {}, 17, nil
  limit = limit or math.huge
  while at <= #element and #items < limit do
    local colon = string.find(element, ':', at, true)
    if not colon then break end
    local length = tonumber(string.sub(element, at, colon - 1))
    if not length then break end
    local item = string.sub(element, colon + 1, colon + length)
    if name == nil then
      name = item
    else
      items[#items + 1] = {name, item}
      name = nil
    end
    at = colon + length + 1
  end
  return items
end

-- Fields an event leaves out when the event before it in the list is a full
-- event (it names its task_id) of the same task with the same value: a
-- write's outcome after its intent. Readers take them from that event.
local inherited = {t = true, o = true, e = true, w = true, q = true, r = true}

local function append_event(events, maxlen, ttl, fields, overrides)
  local seq, head, base_seq, base = 0, '', 0, ''
  local headed = true
  local header = redis.call('LINDEX', events, 0)
  if header then
    local s, h, bs, b = string.match(header, '^te1 (%d+) (%S+) (%d+) (%S+)$')
    if s then
      seq, head, base_seq, base = tonumber(s), h, tonumber(bs), b
      if head == '-' then head = '' end
      if base == '-' then base = '' end
    else
      -- Not a header: the list was changed by hand. The event is stored all
      -- the same (its link starting from '!'), nothing is overwritten or
      -- trimmed, and verifying shows the break.
      headed = false
      seq, head = #redis.call('LRANGE', events, 0, -1), '!'
    end
  end
  seq = seq + 1
  local sent = {}
  for i = 1, #fields, 2 do sent[fields[i]] = fields[i + 1] end
  local before = {}
  if seq - base_seq > 1 and sent['task_id'] then
    -- A full event sends the inherited fields first (with phase and status
    -- among them: AuditEvent's order), so its first eight pairs are enough.
    for _, pair in ipairs(event_items(redis.call('LINDEX', events, -1), 8)) do
      if inherited[pair[1]] then before[pair[1]] = pair[2] end
    end
    if before['t'] ~= sent['task_id'] then before = {} end
  end
  local parts = {}
  for i = 1, #fields, 2 do
    local name, value = stored_name(fields[i]), fields[i + 1]
    if fields[i] ~= 'run_id' and not (inherited[name] and before[name] == value) then
      parts[#parts + 1] = #name .. ':' .. name
      parts[#parts + 1] = #value .. ':' .. value
    end
  end
  for name, value in pairs(overrides) do
    local text = tostring(value)
    if sent[name] ~= text then
      local added = '+' .. stored_name(name)
      parts[#parts + 1] = #added .. ':' .. added
      parts[#parts + 1] = #text .. ':' .. text
    end
  end
  local body = table.concat(parts)
  head = redis.sha1hex(head .. body)
  local element = string.sub(redis.sha1hex(body), 1, 8) .. string.sub(head, 1, 8) .. body
  if not header then
    -- A new list: its header and first event in one command (one event
    -- trims nothing: the settings keep maxlen at 1 or more).
    redis.call('RPUSH', events, 'te1 1 ' .. head .. ' 0 -', element)
    redis.call('EXPIRE', events, ttl)
    return {'1', 1}
  end
  local limit = tonumber(maxlen)
  redis.call('RPUSH', events, element)
  local drop = 0
  if headed and seq - base_seq > limit + math.floor(limit / 10) then
    drop = seq - base_seq - limit
    -- The first event kept must name its task: an outcome that leaves it
    -- out keeps its intent (read from it) one more round.
    local kept = redis.call('LINDEX', events, drop + 1)
    if kept and string.sub(kept, 17, 19) ~= '1:t' then
      drop = drop - 1
    end
  end
  if drop > 0 then
    for _, trimmed in ipairs(redis.call('LRANGE', events, 1, drop)) do
      base = redis.sha1hex(base .. string.sub(trimmed, 17))
    end
    base_seq = base_seq + drop
    -- Index 'drop' (the newest trimmed) becomes index 0, the header, below.
    redis.call('LTRIM', events, drop, -1)
  end
  if headed then
    redis.call('LSET', events, 0, 'te1 ' .. seq .. ' ' .. (head == '' and '-' or head) .. ' '
      .. base_seq .. ' ' .. (base == '' and '-' or base))
  end
  redis.call('EXPIRE', events, ttl)
  return {tostring(seq), seq}
end

-- One server, several databases: a script's databases argument is '' when
-- Celery's result and kombu's messages are in the script's own database (the
-- store's), else '<store> <result backend> <broker>', three database numbers.
-- Their writes then happen after a SELECT of their database, and the script
-- selects the store's again after them. On Redis a script's SELECT is its
-- own: the calling connection's database is unchanged after the script
-- (Redis >= 2.8.12). Never on a cluster (one database there).
local function databases(argument)
  if argument == nil or argument == '' then return nil end
  local store, result, broker = string.match(argument, '^(%d+) (%d+) (%d+)$')
  if store == nil then error('bad databases argument: ' .. argument) end
  return {store = store, result = result, broker = broker}
end

-- Run fn(...) in the database dbs[which] ('result' or 'broker'), then in the
-- store's again.
local function in_database(dbs, which, fn, ...)
  if dbs == nil or dbs[which] == dbs.store then
    return fn(...)
  end
  redis.call('SELECT', dbs[which])
  local out = fn(...)
  redis.call('SELECT', dbs.store)
  return out
end

-- store_result writes Celery's result of a task as Celery's Redis backend does
-- (celery/backends/redis.py, RedisBackend._set): SET, with EX when the
-- result expires, then PUBLISH of the same value on the key, which
-- AsyncResult.get() waits on. expires is a number of seconds, 0 for none.
-- dbs: databases(...) of the script, the result is written in its 'result'.
local function store_result(key, value, expires, dbs)
  in_database(dbs, 'result', function()
    if expires > 0 then
      redis.call('SET', key, value, 'EX', expires)
    else
      redis.call('SET', key, value)
    end
    redis.call('PUBLISH', key, value)
  end)
end

-- ack_message acknowledges a message of kombu's Redis transport as kombu's
-- QoS.ack does (ZREM from unacked_index, HDEL from unacked): the message
-- leaves the broker in the same atomic step as what the calling script records.
-- dbs: databases(...) of the script, the message is in its 'broker'.
local function ack_message(unacked, index, tag, dbs)
  in_database(dbs, 'broker', function()
    redis.call('ZREM', index, tag)
    redis.call('HDEL', unacked, tag)
  end)
end

-- ARGV[from..to] as a Lua list.
local function slice(list, from, to)
  local out = {}
  for i = from, to do out[#out + 1] = list[i] end
  return out
end
