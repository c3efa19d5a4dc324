-- debounce_claim.lua
-- protocol: claim a burst, burst sent, drop a burst (docs/protocol.md, Transitions)
-- The worker's and the producer's moves on a key's pending burst (see debounce_join.lua), by ARGV[1]:
--   'claim': the burst's job holds the lock and asks whether it runs now: when due, the burst ends (its
--            arguments move to KEYS[2], which the job's later copies read) and the job runs with them;
--            before, it is told how long to wait. A copy of a job that was claimed already reads KEYS[2].
--   'sent':  the job's message was published (now): a later call needs no stand-in publish unless it is overdue
--   'drop':  the job's message was not published (the publish raised) or was revoked: the burst ends unrun
-- KEYS[1] - the key's pending burst (hash)
-- KEYS[2] - the claimed job's arguments (string, JSON: [args, kwargs])
-- KEYS[3] - claim: the task id of the newest job that claimed a burst of this lock (string)
-- ARGV[1] - 'claim', 'sent' or 'drop'
-- ARGV[2] - the job (task id)
-- ARGV[3] - claim: how early (ms) a job may claim its burst (a timer's and the clocks' slack)
-- ARGV[4] - claim: how long the claimed arguments live (ms): the job's done window
-- returns claim: {1, seq, args} run now with these arguments (seq 0: read from KEYS[2]); {2, due in ms, seq, args}
--         not due yet; {0} no burst of this job (revoked, expired, or never started on this node); {3} a copy
--         of a job that claimed its burst, when a newer burst's job claimed after it (its run is superseded);
--         sent, drop: 1 when the burst was this job's, else 0
local job = redis.call('HGET', KEYS[1], 'job')
if ARGV[1] == 'sent' then
  if job ~= ARGV[2] then return 0 end
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'sent', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
  return 1
end
if ARGV[1] == 'drop' then
  if job ~= ARGV[2] then return 0 end
  redis.call('DEL', KEYS[1])
  return 1
end
if job == ARGV[2] then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local due = tonumber(redis.call('HGET', KEYS[1], 'due'))
  local seq = redis.call('HGET', KEYS[1], 'seq')
  local args = redis.call('HGET', KEYS[1], 'args')
  if due > now + tonumber(ARGV[3]) then
    return {2, due - now, seq, args}
  end
  redis.call('SET', KEYS[2], args, 'PX', ARGV[4])
  redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[4])
  redis.call('DEL', KEYS[1])
  return {1, seq, args}
end
local claimed = redis.call('GET', KEYS[2])
if claimed then
  local newest = redis.call('GET', KEYS[3])
  if newest and newest ~= ARGV[2] then return {3} end
  return {1, '0', claimed}
end
return {0}
