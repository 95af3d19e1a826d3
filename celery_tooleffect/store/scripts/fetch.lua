-- Take the next message off a worker's queues and record it unacknowledged,
-- in one atomic step (the atomic fetch of celery_tooleffect.store.transport).
--
-- kombu's Redis transport pops a message with BRPOP and only then records it
-- in its unacked hash and index (QoS.append, a second command): a worker
-- killed between the two loses the message. Here both happen in one script,
-- in kombu's own format, so kombu's restore, visibility_timeout and
-- unacked_mutex, and every tool that reads those keys, work unchanged.
--
-- KEYS[1]   kombu's unacked hash (delivery tag -> [payload, exchange, routing key])
-- KEYS[2]   kombu's unacked_index sorted set (delivery tag -> time delivered)
-- KEYS[3..] the queue lists, in the order kombu's BRPOP would try them
--           (every priority step of every queue, global_keyprefix applied)
-- ARGV[1]   now: the score QoS.append gives (the worker's time.time())
-- ARGV[2]   a delivery tag for a message that is no kombu envelope
-- ARGV[3..] the queue name of each list, for a message wrapped as unreadable
--
-- Returns nil when every list is empty, else {position, item, tag, kind}:
-- position is the index of the list in KEYS[3..] (1-based), tag the delivery
-- tag the message is recorded under, kind 'kombu' (item: the message exactly
-- as it was queued) or 'unreadable' (item: a kombu envelope that carries the
-- queued bytes, untouched, as its base64 body; see UNREADABLE below).
--
-- Order of the writes: the message is read (LINDEX), recorded (HSET, ZADD),
-- and only then popped (RPOP). Redis does not roll a script back: a write
-- refused half-way (OOM: HSET and ZADD are refused under maxmemory, RPOP is
-- not) leaves the message in its queue; nothing can leave it in neither.

-- The content type of a message that is no kombu envelope (not JSON, not an
-- object, no properties, no delivery tag ...). Celery's consumer cannot decode
-- it and hands it to on_decode_error, where the package dead-letters it with
-- the queued bytes as its body. kombu's restore puts the envelope, which is
-- valid JSON, back on the queue: an unreadable item is never lost, and never
-- stored where kombu's restore would choke on it.
local UNREADABLE = 'application/x-tooleffect-unreadable'

local B64 = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'

local function base64(data)
  local out = {}
  for i = 1, #data, 3 do
    local a, b, c = string.byte(data, i, i + 2)
    local n = a * 65536 + (b or 0) * 256 + (c or 0)
    local d1 = math.floor(n / 262144) % 64
    local d2 = math.floor(n / 4096) % 64
    local d3 = math.floor(n / 64) % 64
    local d4 = n % 64
    out[#out + 1] = B64:sub(d1 + 1, d1 + 1) .. B64:sub(d2 + 1, d2 + 1)
      .. (b and B64:sub(d3 + 1, d3 + 1) or '=')
      .. (c and B64:sub(d4 + 1, d4 + 1) or '=')
  end
  return table.concat(out)
end

-- The delivery tag, exchange and routing key of a kombu envelope, or nil.
-- A routing field that is no string is recorded as the queue it came from
-- (kombu's restore then puts the message back there: the default exchange).
local function kombu_fields(item, queue)
  local ok, payload = pcall(cjson.decode, item)
  if not ok or type(payload) ~= 'table' then return nil end
  local properties = payload['properties']
  if type(properties) ~= 'table' then return nil end
  local tag = properties['delivery_tag']
  local info = properties['delivery_info']
  if type(tag) ~= 'string' or tag == '' or type(info) ~= 'table' then return nil end
  local exchange, routing_key = info['exchange'], info['routing_key']
  if type(exchange) ~= 'string' or type(routing_key) ~= 'string' then
    return tag, '', queue
  end
  return tag, exchange, routing_key
end

for position = 3, #KEYS do
  local item = redis.call('LINDEX', KEYS[position], -1)
  if item then
    local queue = ARGV[position]
    local tag, exchange, routing_key = kombu_fields(item, queue)
    local kind = 'kombu'
    if not tag then
      tag, exchange, routing_key, kind = ARGV[2], '', queue, 'unreadable'
      item = '{"body": "' .. base64(item) .. '", "content-encoding": "binary", '
        .. '"content-type": "' .. UNREADABLE .. '", "headers": {}, "properties": '
        .. '{"body_encoding": "base64", "delivery_tag": ' .. cjson.encode(tag)
        .. ', "delivery_info": {"exchange": "", "routing_key": '
        .. cjson.encode(queue) .. '}, "priority": 0}}'
    end
    -- kombu's QoS.append: dumps([message._raw, EX, RK]) and the time as score.
    redis.call('HSET', KEYS[1], tag, '[' .. item .. ', ' .. cjson.encode(exchange)
      .. ', ' .. cjson.encode(routing_key) .. ']')
    redis.call('ZADD', KEYS[2], ARGV[1], tag)
    redis.call('RPOP', KEYS[position])
    return {position - 2, item, tag, kind}
  end
end
return nil
