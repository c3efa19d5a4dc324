-- debounce_claim.lua
-- protocol: check a burst, claim a burst, confirm a version, burst sent, drop a burst, undo a join, note a run (docs/protocol.md, Transitions)
-- The worker's and the producer's moves on a key's pending burst (see debounce_join.lua), by ARGV[1]:
--   'check': the burst's job holds the lock and asks whether it runs now (nothing changes): due, or how long to
--            wait. A copy of a job that was claimed already reads KEYS[2].
--   'claim': a quorum of the nodes said the burst is due ('check'): the burst ends here whatever its due time
--            (its versions move to KEYS[2], which the job's later copies read) and the job runs with the newest
--            version (chosen by the caller). Two steps, so that a node that alone finds it due (it missed the
--            later calls) or runs a check late (paused) never ends a burst a quorum keeps.
--   'confirm': the call ARGV[3] joined this job's burst on a quorum of the nodes (its caller was given the job):
--            its version is marked confirmed, so that a claim runs it from any one node that kept it
--   'sent':  the job's message was published (now): a later call needs no stand-in publish unless it is overdue
--   'drop':  the job's message was not published (the publish raised) or was revoked, or its run failed before
--            its claim (no quorum for its lock): the burst ends unrun
--   'undo':  the call ARGV[2] found no quorum and is sent on its own: its version leaves the burst (the burst ends
--            when it was this call's own start); the burst's arguments, expiry and due time go back to the
--            newest version left
--   'ran':   a version is about to run (its job holds the lock): when the key's newest run (KEYS[3]) ran a newer
--            version (a larger stamp), this one is superseded and does not run; else it becomes the newest run
-- KEYS[1] - the key's pending burst (hash)
-- KEYS[2] - the claimed job's versions (string, JSON: the burst's 'hist')
-- KEYS[3] - ran: the key's newest run (hash: at, job, args)
-- ARGV[1] - 'check', 'claim', 'confirm', 'sent', 'drop', 'undo' or 'ran'
-- ARGV[2] - the job (task id); undo: the call's task id (its version)
-- ARGV[3] - check: how early (ms) a job may claim its burst (a timer's and the clocks' slack); confirm: the call's
--           task id (its version); ran: the stamp of the version that runs (µs, text: see debounce_join.lua's 'at')
-- ARGV[4] - claim: how long the claimed versions live (ms): the job's done window; ran: how long the newest run
--           is kept (ms), at least
-- ARGV[5] - ran: the arguments that run (JSON [args, kwargs])
-- returns check: {1, seq, versions} due; {2, due in ms, seq, versions} not due yet; {1, 0, versions} claimed
--         already (KEYS[2]); {0} no burst of this job (revoked, expired, or never started on this node); claim:
--         {1, seq, versions} ended here (seq 0: read from KEYS[2]), {0} none; ran: {1} noted (or the newest run is
--         this one's), {3, job, at, args} a newer version ran (its job, stamp and arguments); confirm, sent, drop,
--         undo: 1 when the burst was changed, else 0
if ARGV[1] == 'ran' then
  local cur = redis.call('HMGET', KEYS[3], 'at', 'job', 'args')
  if cur[1] and tonumber(cur[1]) > tonumber(ARGV[3]) then
    return {3, cur[2], cur[1], cur[3]}
  end
  redis.call('HSET', KEYS[3], 'at', ARGV[3], 'job', ARGV[2], 'args', ARGV[5])
  if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[4]) then
    redis.call('PEXPIRE', KEYS[3], ARGV[4])
  end
  return {1}
end
local job = redis.call('HGET', KEYS[1], 'job')
if ARGV[1] == 'confirm' then
  if job ~= ARGV[2] then return 0 end
  local raw = redis.call('HGET', KEYS[1], 'hist')
  if not raw then return 0 end
  local hist = cjson.decode(raw)
  for i = 1, #hist do
    if hist[i][2] == ARGV[3] then
      while #hist[i] < 6 do hist[i][#hist[i] + 1] = '0' end
      hist[i][7] = 1
      redis.call('HSET', KEYS[1], 'hist', cjson.encode(hist))
      return 1
    end
  end
  return 0
end
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
  local seq = redis.call('HGET', KEYS[1], 'seq')
  local hist = redis.call('HGET', KEYS[1], 'hist')
  if ARGV[1] == 'check' then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local due = tonumber(redis.call('HGET', KEYS[1], 'due'))
    if due > now + tonumber(ARGV[3]) then
      return {2, due - now, seq, hist}
    end
    return {1, seq, hist}
  end
  redis.call('SET', KEYS[2], hist, 'PX', ARGV[4])
  redis.call('DEL', KEYS[1])
  return {1, seq, hist}
end
local claimed = redis.call('GET', KEYS[2])
if claimed then
  return {1, '0', claimed}
end
return {0}
