-- finish.lua
-- protocol: finish, cool down (docs/protocol.md, Transitions)
-- KEYS[1] - lock key (holder record)
-- KEYS[2] - the job's done marker
-- ARGV[1] - owner token
-- ARGV[2] - done marker lifetime (ms) when no copy of the job is known to wait
-- ARGV[3] - done marker lifetime (ms) when one waits (the record says 'waiting'), or the record is not ours
-- ARGV[4] - cooldown in ms: '0' deletes the record; more keeps it that long under ARGV[5], state 'cooldown'
-- ARGV[5] - owner token of the cooldown record
-- returns 1 when the record was ours (now deleted or cooling down), 0 when it was not (left alone); the done
--   marker is set either way: the job did finish
local record = redis.call('HMGET', KEYS[1], 'owner', 'waiting')  -- one read for both fields
local mine = record[1] == ARGV[1]
local ms = ARGV[3]
if mine and not record[2] then
  ms = ARGV[2]
end
redis.call('SET', KEYS[2], '1', 'PX', ms)
if not mine then
  return 0
end
if tonumber(ARGV[4]) > 0 then
  redis.call('HSET', KEYS[1], 'owner', ARGV[5], 'state', 'cooldown')
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
else
  redis.call('DEL', KEYS[1])
end
return 1
