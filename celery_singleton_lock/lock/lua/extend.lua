-- extend.lua
-- protocol: extend, repair, see a stop asked (docs/protocol.md, Transitions)
-- KEYS[2i-1] - lock key of lease i (holder record)
-- KEYS[2i]   - fencing counter key of lease i
-- ARGV[3i-2] - owner token of lease i
-- ARGV[3i-1] - lease in milliseconds
-- ARGV[3i]   - fencing token of lease i
-- returns an array, one code per lease: EXTENDED (1) when the record was ours and its expiry is reset (or, when
--   the record's 'cancel' field is set, that field's value, a string: extended, and its job is asked to stop, in
--   the renewal's own round trip, see cancel.lua);
--   REPAIRED (2) when the key was missing (node restarted or never reached) and is now a record of ours (owner
--   and fence only), with the counter raised to our fencing token; LOST (0) when someone else holds it (or the
--   key is not a record at all: it must not fail the whole batch)
local out = {}
for i = 1, #KEYS / 2 do
  local key, fence = KEYS[2 * i - 1], KEYS[2 * i]
  local token, ms, fencing = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  local kind = redis.call('TYPE', key).ok
  if kind == 'none' then
    redis.call('HSET', key, 'owner', token, 'fence', fencing)
    redis.call('PEXPIRE', key, ms)
    if tonumber(redis.call('GET', fence) or '0') < tonumber(fencing) then
      redis.call('SET', fence, fencing)
    end
    out[i] = 2
  elseif kind == 'hash' and redis.call('HGET', key, 'owner') == token then
    redis.call('PEXPIRE', key, ms)
    out[i] = redis.call('HGET', key, 'cancel') or 1
  else
    out[i] = 0
  end
end
return out
