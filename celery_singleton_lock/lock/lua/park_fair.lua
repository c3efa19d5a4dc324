-- park_fair.lua
-- protocol: park fair (docs/protocol.md, Transitions)
-- Park a job under lock_fair_on (lock_on_duplicate="reschedule"): its place in the line is its value's next turn,
-- so the line pops round-robin across the values of the fair arguments. A value's next turn is the turn after its
-- last one, or the line's current turn when that is later (an idle value is owed no backlog and earns no credit;
-- a value whose last call just ran on the current turn gets the next, never that turn again). Within a turn, jobs
-- are in the order they parked. A job parked before (a woken copy that lost the race, a fallback copy) keeps its
-- place; with a cap (lock_max_waiting) a new job that finds the whole line full is not parked. A job's first park
-- notes the starts counted so far and its value's jobs ahead of it (its turns waited, checked by fair_turn.lua).
-- KEYS[1] - the waiting line of a lock (sorted set: task id -> turn * 1e6 + order of parking within the turn)
-- KEYS[2] - the line's messages (hash: task id -> the message that wakes it, JSON)
-- KEYS[3] - the line's turns (hash: 'now' -> the turn served last, 'parks' -> parks counted, 'starts' -> starts
--           counted, 'last:'..value -> the value's last turn, 'n:'..value -> its jobs parked and not yet run,
--           's:'..id / 'v:'..id -> a job's score and value, 'p:'..id / 'k:'..id -> the starts counted when it first
--           parked and its value's jobs ahead of it then, until it runs)
-- KEYS[4] - the woken jobs on their way (sorted set: task id -> when it is no longer awaited, ms)
-- ARGV[1] - this job's task id
-- ARGV[2] - the message that wakes this job
-- ARGV[3] - expiry of the line, its messages and turns (ms)
-- ARGV[4] - this job's value of the fair arguments
-- ARGV[5] - the cap: lock_max_waiting ('' for none)
-- ARGV[6] - '1': a new job (counted against the cap); '0': a waiting job's own copy
-- returns {1, length} when parked (length: the line's, this job included), {0, length} when the line is full
local id, value = ARGV[1], ARGV[4]
local length = redis.call('ZCARD', KEYS[1])
redis.call('ZREM', KEYS[4], id)
if not redis.call('ZSCORE', KEYS[1], id) then
  if ARGV[5] ~= '' and ARGV[6] == '1' and length >= tonumber(ARGV[5]) then
    return {0, length}
  end
  length = length + 1
  local score = redis.call('HGET', KEYS[3], 's:' .. id)
  if not score then
    local now = tonumber(redis.call('HGET', KEYS[3], 'now') or '0')
    local turn = math.max(now, tonumber(redis.call('HGET', KEYS[3], 'last:' .. value) or '-1') + 1)
    local order = redis.call('HINCRBY', KEYS[3], 'parks', 1) % 1000000
    score = tostring(turn * 1000000 + order)
    local ahead = redis.call('HGET', KEYS[3], 'n:' .. value) or '0'
    local starts = redis.call('HGET', KEYS[3], 'starts') or '0'
    redis.call('HSET', KEYS[3], 'last:' .. value, turn, 's:' .. id, score, 'v:' .. id, value, 'p:' .. id, starts,
      'k:' .. id, ahead)
    redis.call('HINCRBY', KEYS[3], 'n:' .. value, 1)
  end
  redis.call('ZADD', KEYS[1], score, id)
end
redis.call('HSET', KEYS[2], id, ARGV[2])
for i = 1, 4 do
  redis.call('PEXPIRE', KEYS[i], ARGV[3])
end
return {1, length}
