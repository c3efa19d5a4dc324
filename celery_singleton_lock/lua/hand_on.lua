-- hand_on.lua
-- protocol: hand on (docs/protocol.md, Transitions)
-- A run that a newer call stopped (lock_on_duplicate="cancel") hands its lock to the newest call waiting in the key's
-- line, instead of freeing it: a call arriving meanwhile meets the key held (state 'handed', that waiter's job) and
-- is a duplicate, never a run of its own.
-- KEYS[1] - lock key (holder record)
-- KEYS[2] - the done marker of the job that holds it
-- ARGV[1] - our owner token
-- ARGV[2] - the new owner token
-- ARGV[3] - lease of the handed-on lock in milliseconds
-- ARGV[4] - the done marker's lifetime in milliseconds (kept when it exists: a newer call's cancel wrote it)
-- ARGV[5..] - field, value pairs to change in the record (job, state, open, at)
-- returns 1 when the record was ours and now names the new owner (its 'cancel', 'waiting', 'try' and '_prev' fields,
--   the stopped job's, dropped), 0 when it was not ours (left alone); the done marker is set either way: the job ended
redis.call('SET', KEYS[2], '1', 'PX', ARGV[4], 'NX')
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
redis.call('HDEL', KEYS[1], '_prev', 'cancel', 'waiting', 'try')
redis.call('HSET', KEYS[1], 'owner', ARGV[2], unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
