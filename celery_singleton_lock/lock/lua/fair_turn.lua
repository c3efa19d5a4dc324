-- fair_turn.lua
-- protocol: fair turn (docs/protocol.md, Transitions)
-- A job of a fair line (lock_fair_on) holds a slot: may it run? Only on its turn: when no job waits (in the line,
-- or woken and on its way), or its score is the lowest of them all (its own, in the line or the turns' books, kept
-- while it is woken). Being woken gives no right of its own: a woken job that arrives before a lower one woken
-- earlier waits again at its place. When it runs, the start is counted ('starts', while the turns exist), and its turns waited (the
-- starts counted since it first parked) and its value's jobs ahead of it then are returned. Else the slot is the
-- line's: the job parks at its place, gives the slot back, and wakes the head unless as many woken jobs as slots
-- are on their way already.
-- KEYS[1] - the waiting line of a lock (sorted set: task id -> turn * 1e6 + order, see park_fair.lua)
-- KEYS[2] - the woken jobs on their way (sorted set: task id -> when it is no longer awaited, ms)
-- KEYS[3] - the line's turns (hash, see park_fair.lua)
-- ARGV[1] - this job's task id
-- ARGV[2] - now (ms): woken jobs awaited until before it are dropped from KEYS[2]
-- ARGV[3] - the key's limit of runs at once (its slots)
-- returns {1, start, turns waited, ahead} run (start: its number among the line's starts, 0: not counted; -1, -1:
-- it never parked); {0}: not its turn, as many woken jobs as slots are on their way; {2}: not its turn, wake the head
local id = ARGV[1]
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
local mine = redis.call('ZSCORE', KEYS[1], id) or redis.call('HGET', KEYS[3], 's:' .. id)
mine = mine and tonumber(mine)
local turn = true
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if head[1] and head[1] ~= id and (not mine or tonumber(head[2]) < mine) then
  turn = false
end
local woken = redis.call('ZRANGE', KEYS[2], 0, -1)
local others = 0
for _, other in ipairs(woken) do
  if other ~= id then
    others = others + 1
    local score = redis.call('HGET', KEYS[3], 's:' .. other)
    if not mine or (score and tonumber(score) < mine) then
      turn = false
    end
  end
end
if not turn then
  redis.call('ZREM', KEYS[2], id)
  if others >= tonumber(ARGV[3]) then
    return {0}
  end
  return {2}
end
redis.call('ZREM', KEYS[2], id)
if redis.call('EXISTS', KEYS[3]) == 0 then
  return {1, 0, -1, -1}  -- nobody parked in this line lately: no turns to count (and no key left without expiry)
end
local starts = redis.call('HINCRBY', KEYS[3], 'starts', 1)
local parked = redis.call('HGET', KEYS[3], 'p:' .. id)
if not parked then
  return {1, starts, -1, -1}
end
return {1, starts, starts - 1 - tonumber(parked), tonumber(redis.call('HGET', KEYS[3], 'k:' .. id) or '0')}
