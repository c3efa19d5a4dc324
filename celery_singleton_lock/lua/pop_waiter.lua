-- pop_waiter.lua
-- protocol: wake (docs/protocol.md, Transitions)
-- KEYS[1] - the waiting line of a lock (sorted set: task id -> when its call first reached a worker, ms)
-- KEYS[2] - the line's messages (hash: task id -> the message that wakes it, JSON)
-- returns the oldest waiter's message (its task id leaves the line, its message the hash), or nil when none waits
local popped = redis.call('ZPOPMIN', KEYS[1])
if #popped == 0 then return false end
local message = redis.call('HGET', KEYS[2], popped[1])
redis.call('HDEL', KEYS[2], popped[1])
return message
