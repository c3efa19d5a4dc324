-- cancel_job.lua
-- protocol: cancel a job (docs/protocol.md, Transitions)
-- KEYS[1] - the job's done marker (done_key_for(lock key, task id))
-- KEYS[2..] - the lock key's slots (holder records; one for a plain lock)
-- ARGV[1] - the job (task id) to cancel
-- ARGV[2] - the cancel's lifetime in ms (how long a queued copy of the job is still dropped when it arrives)
-- ARGV[3] - the cancel, 'cancel:<who> at <when>': the done marker's value, and the running record's 'cancel' field
-- returns ENDED (0) when the done marker says the job finished (nothing is changed); else the marker is written and:
--   RUNNING (1) a running record of the job was marked (its renewal answers the field: the body is stopped),
--   FREED (2) a record of the job not running (a queue-scope reservation, a retry's hand-over, a lock handed to it
--     by a stopped run) was deleted,
--   PENDING (3) this node holds no record of the job (its queued copies are dropped when they arrive)
local done = redis.call('GET', KEYS[1])
if done and string.sub(done, 1, 7) ~= 'cancel:' then
  return 0
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
local out = 3
for i = 2, #KEYS do
  if redis.call('TYPE', KEYS[i]).ok == 'hash' then
    local job, state = unpack(redis.call('HMGET', KEYS[i], 'job', 'state'))
    if job == ARGV[1] then
      if state == 'run' then
        redis.call('HSET', KEYS[i], 'cancel', ARGV[3])
        out = 1
      elseif state == 'queued' or state == 'sending' or state == 'retry' or state == 'handed' then
        redis.call('DEL', KEYS[i])
        out = 2
      end
    end
  end
end
return out
