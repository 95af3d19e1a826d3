-- Take the next message off a worker's queues and record it unacknowledged,
-- in one atomic step (the atomic fetch of celery_tooleffect.worker.transport).
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
-- ARGV[2..] the queue of each list (ARGV[n - 1] is the queue of KEYS[n])
--
-- Returns nil when every list is empty, else {position, item, tag, kind}:
-- position is the index of the list in KEYS[3..] (1-based) and item the
-- list's next item, exactly as it was queued. kind 'kombu': the item was
-- recorded under its delivery tag, tag, and popped. kind 'unreadable': the
-- item is no kombu envelope (not JSON, not an object, no properties, no
-- delivery tag, headers that are no object ...); nothing was written and it
-- is still queued (tag is empty). The worker wraps it in an envelope of its
-- own (its bytes as a base64 body, which Python encodes in milliseconds
-- where Lua, blocking Redis meanwhile, took seconds for a large item) and
-- takes it with fetch_unreadable.lua, recorded as that envelope.
--
-- Order of the writes: the message is read (LINDEX), recorded (HSET, ZADD),
-- and only then popped (RPOP). Redis does not roll a script back: a write
-- refused half-way (OOM: HSET and ZADD are refused under maxmemory, RPOP is
-- not) leaves the message in its queue; nothing can leave it in neither.

-- The delivery tag, exchange and routing key of a kombu envelope, or nil.
-- A routing field that is no string is recorded as the queue it came from
-- (kombu's restore then puts the message back there: the default exchange).
-- Headers that are there but no object (null, text) make it no envelope:
-- kombu's restore sets headers.redelivered, fails on them, and drops the
-- message. (cjson accepts some JSON that Python's json refuses, hex numbers
-- say; the worker records such an item again as unreadable before it is
-- delivered: AtomicFetch._readable.)
local function kombu_fields(item, queue)
  local ok, payload = pcall(cjson.decode, item)
  if not ok or type(payload) ~= 'table' then return nil end
  local properties = payload['properties']
  if type(properties) ~= 'table' then return nil end
  local headers = payload['headers']
  if headers ~= nil and type(headers) ~= 'table' then return nil end
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
    local tag, exchange, routing_key = kombu_fields(item, ARGV[position - 1])
    if not tag then
      return {position - 2, item, '', 'unreadable'}
    end
    -- kombu's QoS.append: dumps([message._raw, EX, RK]) and the time as score.
    redis.call('HSET', KEYS[1], tag, '[' .. item .. ', ' .. cjson.encode(exchange)
      .. ', ' .. cjson.encode(routing_key) .. ']')
    redis.call('ZADD', KEYS[2], ARGV[1], tag)
    redis.call('RPOP', KEYS[position])
    return {position - 2, item, tag, 'kombu'}
  end
end
return nil
