-- refill.lua
-- protocol: refill (docs/protocol.md, Transitions)
-- KEYS[1] - lock key (holder record)
-- ARGV[1] - owner token
-- ARGV[2..] - field, value pairs of the owner's record
-- returns 1 when the record is ours and now has those fields (a node that lost it and was repaired with owner and
--   fence only), 0 when it is not ours
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
