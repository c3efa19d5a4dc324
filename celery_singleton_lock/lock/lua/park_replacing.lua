-- park_replacing.lua
-- protocol: park replacing (docs/protocol.md, Transitions)
-- Park a job under lock_on_duplicate="replace", by the time its call first reached a worker (ARGV[2]): a job waiting
-- in line that arrived later wins, and this one is marked superseded by the newest; otherwise every other waiting
-- job (all older) leaves the line, marked superseded by this one.
-- KEYS[1] - the waiting line of a lock (sorted set: task id -> arrival, ms)
-- KEYS[2] - the line's messages (hash: task id -> the message that wakes it, JSON)
-- ARGV[1] - this job's task id
-- ARGV[2] - when this job's call first reached a worker (ms)
-- ARGV[3] - the message that wakes this job
-- ARGV[4] - expiry of the line, its messages and the supersession keys (ms)
-- ARGV[5] - supersession key prefix (ARGV[5] .. id names the job that replaced job id); it shares the line's hash
--           tag, so every key lives in one Cluster slot
-- returns {'self', newest id} when a later job waits (this one is marked superseded by it and not parked);
--         else the ids of the jobs this one replaced (each marked superseded by ARGV[1]), this one now parked
local newer = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[2], '+inf', 'WITHSCORES')
for i = 1, #newer, 2 do
  if newer[i] ~= ARGV[1] then
    local newest = redis.call('ZRANGE', KEYS[1], -1, -1)[1]
    redis.call('SET', ARGV[5] .. ARGV[1], newest, 'PX', ARGV[4])
    return {'self', newest}
  end
end
local replaced = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if id ~= ARGV[1] then
    replaced[#replaced + 1] = id
  end
end
for _, id in ipairs(replaced) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  redis.call('SET', ARGV[5] .. id, ARGV[1], 'PX', ARGV[4])
end
redis.call('ZADD', KEYS[1], 'NX', ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return replaced
