-- rate_stack_restamp.lua
-- protocol: restamp a stacked start (docs/protocol.md, Transitions)
-- KEYS[1..k] - the rate logs of a stacked (or costed) start's limits (see rate_stack.lua)
-- ARGV[1] - owner token of the counted start
-- ARGV[1 + i] - the window of limit i, microseconds
-- ARGV[1 + k + i] - the slots limit i's start holds, 'a,b,...'
-- As rate_restamp.lua, for every entry of the start: all move to this node's TIME now, or none when one of them is
-- gone or already out of its window (its slot may be another start's now: that start must not begin).
-- returns {1, now} when every entry was moved (now: TIME, µs); {0} otherwise
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local k = #KEYS
for i = 1, k do
  local window = tonumber(ARGV[1 + i])
  for s in string.gmatch(ARGV[1 + k + i], '%d+') do
    local score = redis.call('ZSCORE', KEYS[i], s .. ':' .. ARGV[1])
    if not score or tonumber(score) <= now - window then
      return {0}
    end
  end
end
for i = 1, k do
  local window = tonumber(ARGV[1 + i])
  for s in string.gmatch(ARGV[1 + k + i], '%d+') do
    redis.call('ZADD', KEYS[i], 'XX', string.format('%.0f', now), s .. ':' .. ARGV[1])
  end
  -- Extended, never shortened: a pause (rate_pause.lua) may keep the log longer than a window.
  if redis.call('PTTL', KEYS[i]) < math.ceil(window / 1000) + 1000 then
    redis.call('PEXPIRE', KEYS[i], math.ceil(window / 1000) + 1000)
  end
end
return {1, now}
