-- debounce_claim.lua
-- protocol: claim a burst, burst sent, drop a burst, undo a join (docs/protocol.md, Transitions)
-- The worker's and the producer's moves on a key's pending burst (see debounce_join.lua), by ARGV[1]:
--   'claim': the burst's job holds the lock and asks whether it runs now: when due, the burst ends (its
--            versions move to KEYS[2], which the job's later copies read) and the job runs with the newest version
--            a quorum of the nodes holds (chosen by the caller); before, it is told how long to wait. A copy of a
--            job that was claimed already reads KEYS[2].
--   'sent':  the job's message was published (now): a later call needs no stand-in publish unless it is overdue
--   'drop':  the job's message was not published (the publish raised) or was revoked: the burst ends unrun
--   'undo':  the call ARGV[2] found no quorum and is sent on its own: its version leaves the burst (the burst ends
--            when it was this call's own start); the burst's arguments, expiry and due time go back to the
--            newest version left
-- KEYS[1] - the key's pending burst (hash)
-- KEYS[2] - the claimed job's versions (string, JSON: the burst's 'hist')
-- KEYS[3] - claim: the task id of the newest job that claimed a burst of this lock (string)
-- ARGV[1] - 'claim', 'sent', 'drop' or 'undo'
-- ARGV[2] - the job (task id); undo: the call's task id (its version)
-- ARGV[3] - claim: how early (ms) a job may claim its burst (a timer's and the clocks' slack)
-- ARGV[4] - claim: how long the claimed versions live (ms): the job's done window
-- returns claim: {1, seq, versions} run now with the newest version a quorum holds (seq 0: read from KEYS[2]);
--         {2, due in ms, seq, versions} not due yet; {0} no burst of this job (revoked, expired, or never started
--         on this node); {3} a copy of a job that claimed its burst, when a newer burst's job claimed after it (its
--         run is superseded); sent, drop, undo: 1 when the burst was changed, else 0
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
if ARGV[1] == 'undo' then
  if not job then return 0 end
  if job == ARGV[2] then
    redis.call('DEL', KEYS[1])
    return 1
  end
  local raw = redis.call('HGET', KEYS[1], 'hist')
  if not raw then return 0 end
  local hist = cjson.decode(raw)
  local found = nil
  for i = 1, #hist do
    if hist[i][2] == ARGV[2] then found = i end
  end
  if not found then return 0 end
  table.remove(hist, found)
  if #hist == 0 then
    redis.call('DEL', KEYS[1])
    return 1
  end
  local top = hist[#hist]
  redis.call('HSET', KEYS[1], 'due', top[4], 'args', top[3], 'exp', top[5], 'hist', cjson.encode(hist))
  return 1
end
if job == ARGV[2] then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local due = tonumber(redis.call('HGET', KEYS[1], 'due'))
  local seq = redis.call('HGET', KEYS[1], 'seq')
  local hist = redis.call('HGET', KEYS[1], 'hist')
  if due > now + tonumber(ARGV[3]) then
    return {2, due - now, seq, hist}
  end
  redis.call('SET', KEYS[2], hist, 'PX', ARGV[4])
  redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[4])
  redis.call('DEL', KEYS[1])
  return {1, seq, hist}
end
local claimed = redis.call('GET', KEYS[2])
if claimed then
  local newest = redis.call('GET', KEYS[3])
  if newest and newest ~= ARGV[2] then return {3} end
  return {1, '0', claimed}
end
return {0}
