-- rate.lua
-- protocol: count a start, refuse a start (docs/protocol.md, Transitions)
-- KEYS[1] - rate key: a sorted set, the sliding log of the starts counted in the last window on this node: member
--           '<slot>:<owner token>', score the start's time by this node's clock (Redis TIME, microseconds)
-- ARGV[1] - owner token of this attempt (fresh for every attempt)
-- ARGV[2] - n, the starts allowed in any window
-- ARGV[3] - the window, microseconds
-- ARGV[4] - the slot to take if it is free, or '' for the lowest free one
-- ARGV[5] - '1': also answer when each slot is free here (a retry after the nodes split their free slots)
-- A start holds one of n slots for one window from its start, so n + 1 starts within one window would need n + 1
-- slots at once: the log never holds more than n starts of any window. Entries that left the window (score <= now -
-- window) are removed first. With n or more entries (n lowered meanwhile: entries of slots >= n) nothing is free.
-- returns {1, slot, now} when the start is counted here (now: this node's TIME, microseconds);
--         {0, microseconds until enough counted starts left the window for one more: the earliest moment here};
--         with ARGV[5] = '1', followed by n numbers: microseconds until slot 0 .. n - 1 is free here (0: free now,
--         as the slot just taken is for the caller, who undoes it if no quorum gave it)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n, window = tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now - window))
local count = redis.call('ZCARD', KEYS[1])
if ARGV[5] ~= '1' then
  -- The common case, no per-slot detail: read only what the answer needs.
  if count >= n then
    -- Full (or fuller, after the rate was lowered): a start fits once all but n - 1 of these left the window; the
    -- log is ordered by start, so that is the entry at index count - n.
    local oldest = redis.call('ZRANGE', KEYS[1], count - n, count - n, 'WITHSCORES')
    return {0, tonumber(oldest[2]) + window - now, 0}
  end
  local slot = tonumber(ARGV[4])
  if not slot or slot >= n then
    slot = 0
  end
  if count > 0 then
    -- The slots of the starts in the window (members only: their times are not needed to take a free one).
    local taken = {}
    for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
      local s = tonumber(string.match(member, '^(%d+):'))
      if s then
        taken[s] = true
      end
    end
    if taken[slot] then
      for s = 0, n - 1 do
        if not taken[s] then
          slot = s
          break
        end
      end
    end
  end
  redis.call('ZADD', KEYS[1], string.format('%.0f', now), slot .. ':' .. ARGV[1])
  -- Extended, never shortened: a pause (rate_pause.lua) may keep the log longer than a window.
  if redis.call('PTTL', KEYS[1]) < math.ceil(window / 1000) + 1000 then
    redis.call('PEXPIRE', KEYS[1], math.ceil(window / 1000) + 1000)
  end
  return {1, slot, now}
end
local log = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local taken = {}
for i = 1, #log, 2 do
  local slot = tonumber(string.match(log[i], '^(%d+):'))
  if slot and slot < n then
    local frees = tonumber(log[i + 1]) + window - now
    taken[slot] = math.max(taken[slot] or 0, frees)
  end
end
local function detail(answer, floor)
  for s = 0, n - 1 do
    answer[#answer + 1] = math.max(floor, taken[s] or 0)
  end
  return answer
end
if count >= n then
  -- Full (or fuller, after the rate was lowered): a start fits once all but n - 1 of these left the window.
  local wait = tonumber(log[2 * (count - n) + 2]) + window - now
  return detail({0, wait, 0}, wait)
end
local slot = tonumber(ARGV[4])
if not slot or slot >= n or taken[slot] then
  slot = nil
  for s = 0, n - 1 do
    if not taken[s] then
      slot = s
      break
    end
  end
end
redis.call('ZADD', KEYS[1], string.format('%.0f', now), slot .. ':' .. ARGV[1])
-- Extended, never shortened: a pause (rate_pause.lua) may keep the log longer than a window.
if redis.call('PTTL', KEYS[1]) < math.ceil(window / 1000) + 1000 then
  redis.call('PEXPIRE', KEYS[1], math.ceil(window / 1000) + 1000)
end
return detail({1, slot, now}, 0)
