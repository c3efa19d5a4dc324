-- fence.lua
-- protocol: fence (docs/protocol.md, Transitions)
-- KEYS[1] - lock key (holder record)
-- KEYS[2] - fencing counter key
-- ARGV[1] - owner token
-- ARGV[2] - fencing token chosen by the quorum
-- returns 1 when the lease is still ours and the counter (and the record's fence) is now >= ARGV[2], 0 when the
--   lease is not ours
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
redis.call('HSET', KEYS[1], 'fence', ARGV[2])
return 1
