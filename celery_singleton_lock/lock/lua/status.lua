-- status.lua
-- protocol: status (docs/protocol.md, Transitions)
-- KEYS[1] - lock key (holder record)
-- KEYS[2] - fencing counter key
-- returns {holder record as a flat field/value array ({} when free or not a record), remaining ms, counter} (a key
--   that is no number, a cancelled job's done marker 'cancel:...', counts as 1: set)
local record = {}
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  record = redis.call('HGETALL', KEYS[1])
end
local n = redis.call('GET', KEYS[2])
return {record, redis.call('PTTL', KEYS[1]), n and (tonumber(n) or 1) or 0}
