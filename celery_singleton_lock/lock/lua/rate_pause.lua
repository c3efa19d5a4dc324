-- rate_pause.lua
-- protocol: pause a rate (docs/protocol.md, Transitions)
-- KEYS[1..k] - the rate logs to pause (a call's limits, or the one its SlowDown named; see rate.lua, rate_stack.lua)
-- ARGV[1] - owner token of the pause (fresh)
-- ARGV[2] - the pause, microseconds
-- ARGV[1 + 2 i] - n of limit i
-- ARGV[2 + 2 i] - the window of limit i, microseconds
-- Fills each log with n entries 'p<j>:<owner token>' scored so that they leave the window exactly when the pause
-- ends (this node's TIME + pause - window; later than now for a pause longer than the window): until then the log
-- holds n entries of the window, so rate.lua and rate_stack.lua refuse every start here and answer the wait until
-- the pause's end. The entries hold no slot. An earlier pause's entries that end sooner are dropped (superseded).
-- returns this node's TIME, microseconds
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local pause = tonumber(ARGV[2])
for i = 1, #KEYS do
  local n, window = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  local score = now + pause - window
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', string.format('%.0f', score))) do
    if string.sub(m, 1, 1) == 'p' then
      redis.call('ZREM', KEYS[i], m)
    end
  end
  for j = 1, n do
    redis.call('ZADD', KEYS[i], string.format('%.0f', score), 'p' .. j .. ':' .. ARGV[1])
  end
  local ttl = math.ceil(math.max(pause, window) / 1000) + 1000
  if redis.call('PTTL', KEYS[i]) < ttl then
    redis.call('PEXPIRE', KEYS[i], ttl)
  end
end
return now
