-- rate_undo.lua
-- protocol: uncount a start (docs/protocol.md, Transitions)
-- KEYS[1..k] - rate keys (the sliding logs, see rate.lua; a stacked start's limits, see rate_stack.lua)
-- ARGV[1] - owner token of an attempt that failed its quorum (or whose body did not start after all)
-- returns the number of entries removed: only that attempt's own entries (each slot it took, each extra charge)
local suffix = ':' .. ARGV[1]
local removed = 0
for k = 1, #KEYS do
  local log = redis.call('ZRANGE', KEYS[k], 0, -1)
  for i = 1, #log do
    local m = log[i]
    if #m > #suffix and string.sub(m, -#suffix) == suffix then
      removed = removed + redis.call('ZREM', KEYS[k], m)
    end
  end
end
return removed
