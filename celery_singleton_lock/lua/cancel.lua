-- cancel.lua
-- protocol: ask to stop (docs/protocol.md, Transitions)
-- KEYS[1] - lock key (holder record)
-- ARGV[1] - the job (task id) asked to stop: only a record of that job, running, is marked
-- ARGV[2] - who asks: the newer call's task id (lock_on_duplicate="cancel")
-- returns 1 when the record was marked (its 'cancel' field set, its expiry kept), 0 when this node holds no running
--   record of that job (it ended, or another job holds the key: nothing is changed)
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then
  return 0
end
local job, state = unpack(redis.call('HMGET', KEYS[1], 'job', 'state'))
if job ~= ARGV[1] or state ~= 'run' then
  return 0
end
redis.call('HSET', KEYS[1], 'cancel', ARGV[2])
return 1
