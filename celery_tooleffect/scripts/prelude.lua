-- Shared by every script of the package; prepended when a script is loaded.
--
-- append_event adds one audit event to a run's stream, numbered by the run's
-- counter, and keeps both keys alive for the retention period. It runs inside
-- the calling script, so an event and the transition it records are stored
-- together or not at all.

local function append_event(stream_key, seq_key, maxlen, ttl, fields, overrides)
  local seq = redis.call('INCR', seq_key)
  local entry = {'seq', tostring(seq)}
  for i = 1, #fields, 2 do
    if overrides[fields[i]] == nil then
      entry[#entry + 1] = fields[i]
      entry[#entry + 1] = fields[i + 1]
    end
  end
  for name, value in pairs(overrides) do
    entry[#entry + 1] = name
    entry[#entry + 1] = tostring(value)
  end
  local id = redis.call('XADD', stream_key, 'MAXLEN', '~', maxlen, '*', unpack(entry))
  redis.call('EXPIRE', stream_key, ttl)
  redis.call('EXPIRE', seq_key, ttl)
  return {id, seq}
end

-- ARGV[from..to] as a Lua list.
local function slice(list, from, to)
  local out = {}
  for i = from, to do out[#out + 1] = list[i] end
  return out
end
