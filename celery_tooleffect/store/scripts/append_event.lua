-- Append one audit event to a run's events (no journal transition); for a
-- READ_ONLY call's outcome, also store Celery's result of the task.
--
-- KEYS[1] run events (a list, prelude.lua)
-- KEYS[2] (optional) Celery's result key of the task: the result is stored
--         there and published on it, as Celery's Redis backend does, together
--         with the event
-- ARGV[1] run events kept (maxlen), ARGV[2] ttl seconds
-- ARGV[3] with KEYS[2]: the result's expiry in seconds ('0' = none)
-- ARGV[4] with KEYS[2]: the result, encoded by Celery's backend ('' without)
-- ARGV[5] the delivery tag of the task's message, to acknowledge with the event
--         ('' = none); then the last two keys are kombu's unacked hash and
--         unacked_index (the broker is this Redis)
-- ARGV[6] the databases of the result and the message when either is not the
--         store's (prelude.lua, databases: '<store> <result> <broker>'), or ''
-- ARGV[7..] event field/value pairs
-- Returns {seq as text, seq}.

local ack_tag = ARGV[5]
local dbs = databases(ARGV[6])
local result_keys = #KEYS
if ack_tag ~= '' then result_keys = result_keys - 2 end
local appended = append_event(KEYS[1], ARGV[1], ARGV[2], slice(ARGV, 7, #ARGV), {})
if result_keys >= 2 then
  store_result(KEYS[2], ARGV[4], tonumber(ARGV[3]), dbs)
end
if ack_tag ~= '' then
  ack_message(KEYS[#KEYS - 1], KEYS[#KEYS], ack_tag, dbs)
end
return appended
