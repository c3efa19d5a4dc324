-- cancel.lua
-- protocol: ask to stop (docs/protocol.md, Transitions)
-- KEYS[1] - lock key (holder record)
-- KEYS[2] - the done marker of the job asked to stop
-- ARGV[1] - the job (task id) asked to stop: only a record of that job, running, is marked
-- ARGV[2] - who asks: the newer call's task id (lock_on_duplicate="cancel")
-- ARGV[3] - the done marker's value, 'cancel:a newer call, task <id>', and ARGV[4] its lifetime (ms): set unless a
--   marker exists, so that a copy of the stopped job (redelivered after its worker died before it saw the request,
--   or its body's retry) is dropped, never run after its successor; the job's own finish overwrites it
-- ARGV[5] - when the asking call first reached a worker plus a clock margin (ms; policies.cancel.CLOCK_MARGIN), or
--   '': a record whose 'since' is later is a newer call's run, never asked to stop by an older one
-- returns 1 when the record was marked (its 'cancel' field set, its expiry kept), 2 when the running record is a
--   newer call's (its 'since' later than ARGV[5]: nothing is changed), 0 when this node holds no running record of
--   that job (it ended, or another job holds the key: nothing is changed)
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then
  return 0
end
local job, state, since = unpack(redis.call('HMGET', KEYS[1], 'job', 'state', 'since'))
if job ~= ARGV[1] or state ~= 'run' then
  return 0
end
if ARGV[5] ~= '' and since and tonumber(since) and tonumber(ARGV[5]) and tonumber(since) > tonumber(ARGV[5]) then
  return 2
end
redis.call('HSET', KEYS[1], 'cancel', ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4], 'NX')
return 1
