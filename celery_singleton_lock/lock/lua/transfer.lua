-- transfer.lua
-- protocol: sent, hand over (docs/protocol.md, Transitions)
-- KEYS[1] - lock key (holder record)
-- ARGV[1] - our owner token
-- ARGV[2] - the new owner token
-- ARGV[3] - lease of the handed-over lock in milliseconds
-- ARGV[4..] - field, value pairs to change in the record (e.g. state)
-- returns 1 when the record was ours and now names the new owner, 0 when it was not ours (left alone)
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], unpack(ARGV, 4))
  redis.call('HDEL', KEYS[1], '_prev')  -- the take-over that wrote it succeeded long ago: nothing to undo
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
