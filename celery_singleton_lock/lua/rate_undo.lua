-- rate_undo.lua
-- protocol: uncount a start (docs/protocol.md, Transitions)
-- KEYS[1] - rate key (the sliding log, see rate.lua)
-- ARGV[1] - owner token of an attempt that failed its quorum (or whose body did not start after all)
-- returns the number of entries removed (0 or 1): only that attempt's own entry, whatever its slot
local log = redis.call('ZRANGE', KEYS[1], 0, -1)
local suffix = ':' .. ARGV[1]
local removed = 0
for i = 1, #log do
  local m = log[i]
  if #m > #suffix and string.sub(m, -#suffix) == suffix then
    removed = removed + redis.call('ZREM', KEYS[1], m)
  end
end
return removed
