-- rate_adjust.lua
-- protocol: correct a start's cost (docs/protocol.md, Transitions)
-- KEYS[1..k] - the rate logs of a counted start's limits (see rate_stack.lua)
-- ARGV[1] - owner token of the counted start
-- ARGV[2] - units to add (> 0: an extra charge) or give back (< 0: a refund) in each log, 'd1,d2,...' (one per
--           key), or one number for every key
-- ARGV[2 + i] - the window of limit i, microseconds
-- A refund removes that many of the start's entries from each log (extra charges first, then its highest slots:
-- those slots are free again at once). An extra charge adds entries 'x<i>:<owner token>' at this node's TIME: they
-- hold no slot but count against every start's room (rate_stack.lua) for one window from now.
-- returns the number of entries added or removed in the first log
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local deltas = {}
for x in string.gmatch(ARGV[2], '-?%d+') do
  deltas[#deltas + 1] = tonumber(x)
end
local suffix = ':' .. ARGV[1]
local done = 0
for i = 1, #KEYS do
  local window, delta = tonumber(ARGV[2 + i]), deltas[i] or deltas[1]
  local mine, extra = {}, 0
  for _, m in ipairs(redis.call('ZRANGE', KEYS[i], 0, -1)) do
    if #m > #suffix and string.sub(m, -#suffix) == suffix then
      local head = string.sub(m, 1, #m - #suffix)
      if string.sub(head, 1, 1) == 'x' then
        extra = extra + 1
        mine[#mine + 1] = {1e18, m}
      else
        mine[#mine + 1] = {tonumber(head) or 0, m}
      end
    end
  end
  local changed = 0
  if delta < 0 then
    table.sort(mine, function(a, b) return a[1] > b[1] end)
    for j = 1, math.min(-delta, #mine) do
      changed = changed + redis.call('ZREM', KEYS[i], mine[j][2])
    end
  elseif delta > 0 then
    for j = 1, delta do
      redis.call('ZADD', KEYS[i], string.format('%.0f', now), 'x' .. (extra + j) .. '-' .. now .. suffix)
      changed = changed + 1
    end
    -- Extended, never shortened: a pause (rate_pause.lua) may keep the log longer than a window.
    if redis.call('PTTL', KEYS[i]) < math.ceil(window / 1000) + 1000 then
      redis.call('PEXPIRE', KEYS[i], math.ceil(window / 1000) + 1000)
    end
  end
  if i == 1 then
    done = changed
  end
end
return done
