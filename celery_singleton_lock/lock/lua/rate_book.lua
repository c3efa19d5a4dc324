-- rate_book.lua
-- protocol: book a start (docs/protocol.md, Transitions)
-- KEYS[1] - rate key (the sliding log, see rate.lua): member '<slot>:<owner token>', score the start's time by this
--           node's clock (Redis TIME, µs); a booking is such an entry scored in the future, the moment it owns
-- ARGV[1] - owner token of this attempt (fresh for every attempt)
-- ARGV[2] - n, the starts allowed in any window
-- ARGV[3] - the window, microseconds
-- ARGV[4] - '' (a first round: the slot free soonest, the lowest of those) or the slot to take (a second round)
-- ARGV[5] - not before: µs from now ('' or 0: now), the latest moment a majority named in a first round (its
--           nodes book the same moment, each by its own clock, instead of each its own)
-- Each slot is a chain of entries, each holding it for one window from its score: the slot is free from the end of
-- its last entry (now, if it has none). The start takes the slot free soonest, at max(now, that end): now (counted,
-- as rate.lua does) or a later moment (booked: it must start then, not before), after every earlier booking. Entries
-- that hold no slot here (a pause's, an extra charge's, a slot >= n after n was lowered) hold every slot until they
-- leave the window. A slot's successive entries are thus a window apart at least: never more than n in a window.
-- returns {1, slot, now, now} when counted now; {2, slot, the booked moment, now} when booked (µs, this node's TIME)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n, window = tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now - window))
local log = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local frees, floor = {}, now + (tonumber(ARGV[5]) or 0)
for i = 1, #log, 2 do
  local slot = tonumber(string.match(log[i], '^(%d+):'))
  local ends = tonumber(log[i + 1]) + window
  if slot and slot < n then
    frees[slot] = math.max(frees[slot] or now, ends)
  else
    floor = math.max(floor, ends)
  end
end
local best, at = 0, nil
for s = 0, n - 1 do
  local free = math.max(floor, frees[s] or now)
  if not at or free < at then
    best, at = s, free
  end
end
local preferred = tonumber(ARGV[4])
if preferred and preferred < n then
  -- A second round: the slot the most nodes named, at the latest moment named or when it is free here, if later
  -- (the nodes then agree on the slot whatever order contenders reached each of them in).
  best, at = preferred, math.max(floor, frees[preferred] or now)
end
redis.call('ZADD', KEYS[1], string.format('%.0f', at), best .. ':' .. ARGV[1])
local ttl = math.ceil((at + window - now) / 1000) + 1000
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
if at <= now then
  return {1, best, now, now}
end
return {2, best, at, now}
