-- Shared by every script of the package; prepended when a script is loaded.
--
-- append_event adds one audit event to a run's stream and keeps the run's keys
-- alive for the retention period. It runs inside the calling script, so an
-- event and the transition it records are stored together or not at all.
--
-- The run's chain key (a hash) numbers the events ('seq') and holds the hash
-- of the newest one ('head'). Each event carries 'prev', the hash of the event
-- before it, and 'hash', the SHA-1 of all its other fields in the order they
-- are stored, each written as <byte length>:<bytes>. Editing or deleting an
-- event breaks the chain at that point (see AuditLog.verify).

local function canonical(entry)
  local parts = {}
  for i = 1, #entry do
    parts[#parts + 1] = #entry[i] .. ':' .. entry[i]
  end
  return table.concat(parts)
end

local function append_event(stream_key, chain_key, maxlen, ttl, fields, overrides)
  local seq = redis.call('HINCRBY', chain_key, 'seq', 1)
  local prev = redis.call('HGET', chain_key, 'head') or ''
  local entry = {'seq', tostring(seq)}
  for i = 1, #fields, 2 do
    if overrides[fields[i]] == nil and fields[i] ~= 'prev' and fields[i] ~= 'hash' then
      entry[#entry + 1] = fields[i]
      entry[#entry + 1] = fields[i + 1]
    end
  end
  for name, value in pairs(overrides) do
    entry[#entry + 1] = name
    entry[#entry + 1] = tostring(value)
  end
  entry[#entry + 1] = 'prev'
  entry[#entry + 1] = prev
  local hash = redis.sha1hex(canonical(entry))
  entry[#entry + 1] = 'hash'
  entry[#entry + 1] = hash
  local id = redis.call('XADD', stream_key, 'MAXLEN', '~', maxlen, '*', unpack(entry))
  redis.call('HSET', chain_key, 'head', hash)
  redis.call('EXPIRE', stream_key, ttl)
  redis.call('EXPIRE', chain_key, ttl)
  return {id, seq}
end

-- store_result writes Celery's result of a task as Celery's Redis backend does
-- (celery/backends/redis.py, RedisBackend._set): SET, with EX when the
-- result expires, then PUBLISH of the same value on the key, which
-- AsyncResult.get() waits on. expires is a number of seconds, 0 for none.
local function store_result(key, value, expires)
  if expires > 0 then
    redis.call('SET', key, value, 'EX', expires)
  else
    redis.call('SET', key, value)
  end
  redis.call('PUBLISH', key, value)
end

-- ack_message acknowledges a message of kombu's Redis transport as kombu's
-- QoS.ack does (ZREM from unacked_index, HDEL from unacked): the message
-- leaves the broker in the same atomic step as what the calling script records.
local function ack_message(unacked, index, tag)
  redis.call('ZREM', index, tag)
  redis.call('HDEL', unacked, tag)
end

-- ARGV[from..to] as a Lua list.
local function slice(list, from, to)
  local out = {}
  for i = from, to do out[#out + 1] = list[i] end
  return out
end
