-- Append one audit event to a run's stream (no journal transition).
--
-- KEYS[1] run stream, KEYS[2] run event counter
-- ARGV[1] stream MAXLEN, ARGV[2] ttl seconds, ARGV[3..] field/value pairs
-- Returns {entry id, seq}.

return append_event(KEYS[1], KEYS[2], ARGV[1], ARGV[2], slice(ARGV, 3, #ARGV), {})
