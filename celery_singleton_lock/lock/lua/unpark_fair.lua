-- unpark_fair.lua
-- protocol: unpark fair (docs/protocol.md, Transitions)
-- A job of a fair line got its slot: it leaves the line, its message, the woken jobs on their way and the turns'
-- books (its value's count of jobs parked; the value's last turn is kept while it is the current turn, so the
-- value's next call takes the next turn); the turn served moves up to this job's, so a value that arrives later
-- starts there.
-- KEYS[1] - the waiting line of a lock (sorted set: task id -> turn * 1e6 + order, see park_fair.lua)
-- KEYS[2] - the line's messages (hash: task id -> the message that wakes it, JSON)
-- KEYS[3] - the line's turns (hash, see park_fair.lua)
-- KEYS[4] - the woken jobs on their way (sorted set: task id -> when it is no longer awaited, ms)
-- ARGV[1] - this job's task id
-- returns 1 when the job was in the turns' books, 0 when not
local id = ARGV[1]
redis.call('ZREM', KEYS[1], id)
redis.call('HDEL', KEYS[2], id)
redis.call('ZREM', KEYS[4], id)
local value = redis.call('HGET', KEYS[3], 'v:' .. id)
local score = redis.call('HGET', KEYS[3], 's:' .. id)
redis.call('HDEL', KEYS[3], 'v:' .. id, 's:' .. id, 'p:' .. id, 'k:' .. id)
if not value or not score then
  return 0
end
local turn = math.floor(tonumber(score) / 1000000)
local now = tonumber(redis.call('HGET', KEYS[3], 'now') or '0')
if turn > now then
  now = turn
  redis.call('HSET', KEYS[3], 'now', turn)
end
if redis.call('HINCRBY', KEYS[3], 'n:' .. value, -1) <= 0 then
  redis.call('HDEL', KEYS[3], 'n:' .. value)
  if tonumber(redis.call('HGET', KEYS[3], 'last:' .. value) or '-1') < now then
    redis.call('HDEL', KEYS[3], 'last:' .. value)  -- the current turn is later: the value's next call starts there
  end
end
return 1
