-- park_capped.lua
-- protocol: park capped (docs/protocol.md, Transitions)
-- Park a job under lock_on_duplicate="reschedule" with lock_max_waiting=N: a new duplicate that finds N jobs
-- waiting already is not parked (the line is full); a job already in the line (its own fallback copy) keeps its
-- place, and a waiting job's own re-sends and wake-ups (ARGV[6] = '0') are never refused.
-- KEYS[1] - the waiting line of a lock (sorted set: task id -> arrival, ms)
-- KEYS[2] - the line's messages (hash: task id -> the message that wakes it, JSON)
-- ARGV[1] - this job's task id
-- ARGV[2] - when this job's call first reached a worker (ms)
-- ARGV[3] - the message that wakes this job
-- ARGV[4] - expiry of the line and its messages (ms)
-- ARGV[5] - the cap: lock_max_waiting
-- ARGV[6] - '1': a new duplicate (counted against the cap); '0': a waiting job's own copy
-- returns {1, length} when parked (length: the line's, this job included), {0, length} when the line is full
local length = redis.call('ZCARD', KEYS[1])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  if ARGV[6] == '1' and length >= tonumber(ARGV[5]) then
    return {0, length}
  end
  length = length + 1
end
redis.call('ZADD', KEYS[1], 'NX', ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {1, length}
