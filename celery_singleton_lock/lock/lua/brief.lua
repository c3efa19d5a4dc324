-- brief.lua
-- protocol: brief (docs/protocol.md, Transitions)
-- KEYS[i] - a key under the prefix (a SCAN batch)
-- returns an array, one string per key: '' when it is missing, '-' when it is not a holder record (another type, or
--   a hash without 'owner'), else its owner, state and name joined by the unit separator (byte 31; '' for a field
--   that is absent): a few bytes a key, so the locks page can sort 10,000 keys without reading every record
local out = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local kind = redis.call('TYPE', key).ok
  if kind == 'none' then
    out[i] = ''
  elseif kind ~= 'hash' then
    out[i] = '-'
  else
    local v = redis.call('HMGET', key, 'owner', 'state', 'name')
    if not v[1] then
      out[i] = '-'
    else
      out[i] = v[1] .. '\31' .. (v[2] or '') .. '\31' .. (v[3] or '')
    end
  end
end
return out
