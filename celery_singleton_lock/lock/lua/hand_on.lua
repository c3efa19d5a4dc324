-- hand_on.lua
-- protocol: hand on (docs/protocol.md, Transitions)
-- A run that a newer call stopped (lock_on_duplicate="cancel") hands its lock to the newest call waiting in the key's
-- line, instead of freeing it: a call arriving meanwhile meets the key held (state 'handed', that waiter's job) and
-- is a duplicate, never a run of its own.
-- KEYS[1] - lock key (holder record)
-- KEYS[2] - the done marker of the job that holds it
-- KEYS[3] - the done marker of the job it is handed to: when it exists (that call was cancelled by task id, or ran
--   already), nothing is handed (the caller frees the lock instead: a call that never runs must never hold it)
-- ARGV[1] - our owner token
-- ARGV[2] - the new owner token
-- ARGV[3] - lease of the handed-on lock in milliseconds
-- ARGV[4] - the done marker's lifetime in milliseconds (kept when it exists: a newer call's cancel wrote it)
-- ARGV[5..] - field, value pairs to change in the record (job, state, open, at)
-- returns 1 when the record was ours and now names the new owner (its 'cancel', 'waiting', 'try', 'worker' and
--   '_prev' fields, the stopped job's, dropped: the new owner runs nowhere yet), 0 when it was not ours (left alone), 2 when the new owner's job has ended (KEYS[3]
--   exists: left alone); the holder's done marker is set either way: its job ended
redis.call('SET', KEYS[2], '1', 'PX', ARGV[4], 'NX')
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return 2
end
redis.call('HDEL', KEYS[1], '_prev', 'cancel', 'waiting', 'try', 'worker')
redis.call('HSET', KEYS[1], 'owner', ARGV[2], unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
