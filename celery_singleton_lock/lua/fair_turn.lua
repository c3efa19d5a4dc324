-- fair_turn.lua
-- protocol: fair turn (docs/protocol.md, Transitions)
-- A job of a fair line (lock_fair_on) that took a free slot without being woken (its first delivery, its fallback
-- copy): may it run? Yes when nobody waits in the line or it is the line's head; else the slot is the line's: it
-- parks, gives the slot back, and wakes the head unless as many woken jobs as slots are on their way already.
-- KEYS[1] - the waiting line of a lock (sorted set: task id -> turn * 1e6 + order, see park_fair.lua)
-- KEYS[2] - the woken jobs on their way (sorted set: task id -> when it is no longer awaited, ms)
-- ARGV[1] - this job's task id
-- ARGV[2] - now (ms): woken jobs awaited until before it are dropped from KEYS[2]
-- ARGV[3] - the key's limit of runs at once (its slots)
-- returns 1: run; 0: not its turn, a woken job is on its way for the slot; 2: not its turn, wake the head
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
local head = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
if not head or head == ARGV[1] then
  return 1
end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[3]) then
  return 0
end
return 2
