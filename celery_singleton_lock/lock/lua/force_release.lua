-- force_release.lua
-- protocol: force release (docs/protocol.md, Transitions)
-- KEYS[1] - lock key (holder record)
-- ARGV[1] - the record's owner read from this node a moment ago
-- returns {RELEASED} when the record still names ARGV[1] as its owner and is now deleted;
--         {CHANGED, current owner or false, Redis type} when it changed in between (a newer holder, or a key
--         that is no longer a holder record, is left alone)
local kind = redis.call('TYPE', KEYS[1]).ok
local owner = false
if kind == 'hash' then
  owner = redis.call('HGET', KEYS[1], 'owner')
  if owner == ARGV[1] then
    redis.call('DEL', KEYS[1])
    return {1}
  end
end
return {0, owner, kind}
