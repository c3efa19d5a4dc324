-- rate_stack.lua
-- protocol: count a stacked start, refuse a stacked start (docs/protocol.md, Transitions)
-- KEYS[1..k] - the rate logs of the k limits of one call (sorted sets, see rate.lua): member '<slot>:<owner token>'
--              for a slot a start holds, 'x<i>:<owner token>' for units charged after its run (rate_adjust.lua)
-- ARGV[1] - owner token of this attempt (fresh for every attempt)
-- ARGV[2] - the units this start takes of each limit, 'c1,c2,...' (its cost per limit: c_i slots of limit i), or
--           one number c for every limit
-- ARGV[3] - '1': also answer when each slot of each limit is free here (a retry after the nodes split their slots)
-- ARGV[4 + 3 (i - 1)] - n of limit i, the units allowed in any of its windows
-- ARGV[5 + 3 (i - 1)] - the window of limit i, microseconds
-- ARGV[6 + 3 (i - 1)] - the slots of limit i to take if they are free ('a,b,...'), or '' for the lowest free ones
-- All or none: the start is logged only if every limit i has room for c_i more units (its log holds at most n - c_i
-- entries in the window) and c_i free slots; then it takes c_i slots of each limit at this node's TIME. A start holds
-- each of its slots for one window from its start, as in rate.lua: a log never holds more than n slots' starts of
-- any window. Entries that left a window are removed first.
-- returns {1, now, the c_1 slots of limit 1, ..., the c_k slots of limit k} when counted here (now: TIME, µs);
--         {0, µs until every refusing limit has room here (the max over them), 0};
--         with ARGV[3] = '1', followed per limit by n numbers: µs until its slot 0 .. n - 1 is free here (at least
--         that limit's own wait when it has no room)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local detail = ARGV[3] == '1'
local k = #KEYS
local cs = {}
for x in string.gmatch(ARGV[2], '%d+') do
  cs[#cs + 1] = tonumber(x)
end
local wait, waits = -1, {}
for i = 1, k do
  local n, window, c = tonumber(ARGV[1 + 3 * i]), tonumber(ARGV[2 + 3 * i]), cs[i] or cs[1]
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', string.format('%.0f', now - window))
  local count = redis.call('ZCARD', KEYS[i])
  waits[i] = 0
  if count + c > n then
    -- No room: c more fit once all but n - c of these left the window (ordered by start: index count + c - n - 1).
    local at = count + c - n - 1
    local oldest = redis.call('ZRANGE', KEYS[i], at, at, 'WITHSCORES')
    waits[i] = math.max(1, tonumber(oldest[2]) + window - now)
    wait = math.max(wait, waits[i])
  end
end
if wait >= 0 and not detail then
  return {0, wait, 0}
end
local answer = {1, now}
if wait >= 0 then
  answer = {0, wait, 0}
end
local frees, picks = {}, {}
for i = 1, k do
  local n, window = tonumber(ARGV[1 + 3 * i]), tonumber(ARGV[2 + 3 * i])
  local taken = {}
  if detail then
    local log = redis.call('ZRANGE', KEYS[i], 0, -1, 'WITHSCORES')
    for j = 1, #log, 2 do
      local s = tonumber(string.match(log[j], '^(%d+):'))
      if s and s < n then
        taken[s] = math.max(taken[s] or 0, tonumber(log[j + 1]) + window - now)
      end
    end
  else
    for _, member in ipairs(redis.call('ZRANGE', KEYS[i], 0, -1)) do
      local s = tonumber(string.match(member, '^(%d+):'))
      if s then
        taken[s] = 1
      end
    end
  end
  frees[i] = taken
  if wait < 0 then
    local c = cs[i] or cs[1]
    local pick, chosen = {}, {}
    for s in string.gmatch(ARGV[3 + 3 * i], '%d+') do
      s = tonumber(s)
      if #pick < c and s < n and not taken[s] and not chosen[s] then
        pick[#pick + 1], chosen[s] = s, true
      end
    end
    for s = 0, n - 1 do
      if #pick >= c then
        break
      end
      if not taken[s] and not chosen[s] then
        pick[#pick + 1], chosen[s] = s, true
      end
    end
    if #pick < c then
      -- Room by count but not c free slots (n lowered meanwhile: entries of slots >= n): nothing is free.
      return {0, 1, 0}
    end
    picks[i] = pick
  end
end
if wait < 0 then
  for i = 1, k do
    local window = tonumber(ARGV[2 + 3 * i])
    for _, s in ipairs(picks[i]) do
      redis.call('ZADD', KEYS[i], string.format('%.0f', now), s .. ':' .. ARGV[1])
      answer[#answer + 1] = s
    end
    -- Extended, never shortened: a pause (rate_pause.lua) may keep the log longer than a window.
    if redis.call('PTTL', KEYS[i]) < math.ceil(window / 1000) + 1000 then
      redis.call('PEXPIRE', KEYS[i], math.ceil(window / 1000) + 1000)
    end
  end
end
if detail then
  for i = 1, k do
    local n = tonumber(ARGV[1 + 3 * i])
    for s = 0, n - 1 do
      answer[#answer + 1] = math.max(waits[i], frees[i][s] or 0)
    end
  end
end
return answer
