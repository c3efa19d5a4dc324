-- release.lua
-- protocol: release, unsent, free a reservation (docs/protocol.md, Transitions)
-- KEYS[1] - lock key (holder record)
-- ARGV[1] - owner token
-- returns 1 when the record was ours and is now deleted, 0 when it was not ours (left alone)
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
