-- pop_waiter.lua
-- protocol: wake (docs/protocol.md, Transitions)
-- KEYS[1] - the waiting line of a lock (sorted set: task id -> when its call first reached a worker, ms; under
--           lock_fair_on: its turn * 1e6 + order, see park_fair.lua)
-- KEYS[2] - the line's messages (hash: task id -> the message that wakes it, JSON)
-- KEYS[3] - (lock_fair_on only) the line's turns (hash, see park_fair.lua): 'now' moves up to the popped job's turn
-- KEYS[4] - (lock_fair_on only) the woken jobs on their way (sorted set): the popped job is added, awaited until
--           ARGV[1] (ms); the set expires ARGV[2] ms later, as the line. None is popped while ARGV[4] (the key's
--           limit) woken jobs are still awaited at ARGV[3] (now, ms): as many as slots are on their way already
-- returns the head's message (its task id leaves the line, its message the hash), or nil when none waits (or none
-- is woken)
local fair = #KEYS >= 4
if fair then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[3])
  if redis.call('ZCARD', KEYS[4]) >= tonumber(ARGV[4]) then
    return false
  end
end
local popped = redis.call('ZPOPMIN', KEYS[1])
if #popped == 0 then return false end
local message = redis.call('HGET', KEYS[2], popped[1])
redis.call('HDEL', KEYS[2], popped[1])
if fair then
  local turn = math.floor(tonumber(popped[2]) / 1000000)
  if turn > tonumber(redis.call('HGET', KEYS[3], 'now') or '0') then
    redis.call('HSET', KEYS[3], 'now', turn)
  end
  redis.call('ZADD', KEYS[4], ARGV[1], popped[1])
  redis.call('PEXPIRE', KEYS[4], ARGV[2])
end
return message
