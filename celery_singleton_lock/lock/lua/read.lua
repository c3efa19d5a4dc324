-- read.lua
-- protocol: read (docs/protocol.md, Transitions)
-- KEYS[i] - a key under the prefix: a lock's holder record, a done marker, or anything else
-- ARGV[1] - the most fields a holder record may have (a larger hash is not read: it is not one of ours)
-- returns an array, one {Redis type ('none': missing), holder record as a flat field/value array, remaining ms
--   (-2 missing, -1 no expiry)} per key; the record is {} unless the key is a hash with an 'owner' field
local out = {}
local most = tonumber(ARGV[1])
for i = 1, #KEYS do
  local key = KEYS[i]
  local kind = redis.call('TYPE', key).ok
  local record = {}
  if kind == 'hash' and redis.call('HLEN', key) <= most and redis.call('HEXISTS', key, 'owner') == 1 then
    record = redis.call('HGETALL', key)
  end
  out[i] = {kind, record, redis.call('PTTL', key)}
end
return out
