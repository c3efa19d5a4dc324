-- rate_restamp.lua
-- protocol: restamp a start (docs/protocol.md, Transitions)
-- KEYS[1] - rate key (the sliding log, see rate.lua)
-- ARGV[1] - the entry of a counted start, '<slot>:<owner token>'
-- ARGV[2] - the window, microseconds
-- A start whose answers came back late begins its body later than the nodes counted it: its entry moves to this
-- node's TIME now, so its slot's next start comes one window after this moment, not after the count. An entry that
-- already left the window (its slot may be another start's now) is left alone: that start must not begin.
-- returns {1, now} when the entry was moved (now: this node's TIME, microseconds); {0} when it is gone or out of the
--         window
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = tonumber(ARGV[2])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now - window then
  return {0}
end
redis.call('ZADD', KEYS[1], 'XX', string.format('%.0f', now), ARGV[1])
-- Extended, never shortened: a pause (rate_pause.lua) may keep the log longer than a window.
if redis.call('PTTL', KEYS[1]) < math.ceil(window / 1000) + 1000 then
  redis.call('PEXPIRE', KEYS[1], math.ceil(window / 1000) + 1000)
end
return {1, now}
