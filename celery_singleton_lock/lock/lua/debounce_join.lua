-- debounce_join.lua
-- protocol: debounce, join a burst, stand in (docs/protocol.md, Transitions)
-- A call of a task with lock_debounce: start the key's burst (this call's task id is its job), or join the burst
-- under way (its job runs later, with this call's arguments). Times are the node's own clock (TIME).
-- Each call is a version of the burst, named by its own task id: the burst keeps its last 16 versions ('hist', JSON
-- [[n, call id, args, due, expires, at], ...], oldest first), so that the claim runs the newest version a quorum of
-- the nodes holds, and a call that found no quorum (sent on its own) takes its version back ('undo',
-- debounce_claim.lua). 'at': when this node took the call (its TIME in µs, as text: cjson and tostring keep 14
-- digits), the version's stamp, which orders it against the key's newest run ('ran', debounce_claim.lua).
-- KEYS[1] - the key's pending burst (hash: job, first, due, seq, args, exp, hist, sent, name, at)
-- ARGV[1] - this call's task id (the job of a burst it starts; the name of this call's version)
-- ARGV[2] - this call's quiet period (ms): lock_debounce, plus the call's countdown
-- ARGV[3] - lock_debounce_max (ms; 0: none): the burst's run is never due later than this after its first call
-- ARGV[4] - this call's arguments (JSON: [args, kwargs])
-- ARGV[5] - how long the burst outlives its due time (ms): lock_queue_ttl, at least the job's done window
-- ARGV[6] - the task's name
-- ARGV[7] - after how long (ms) a burst whose message was never marked sent gets a stand-in publish
-- ARGV[8] - after how long (ms) past its due time, and since its last publish, a burst whose job has not claimed
--           it gets a stand-in publish (its message was lost: a worker killed between its ack and its re-send)
-- ARGV[9] - this call's expiry (Unix ms; 0 or absent: none): a run carrying this call's arguments expires then
-- returns {answer, job, due in ms, seq, past due in ms, at}: answer 1 when this call started the burst (it publishes the
--         job's message), 0 when it joined it, 2 when it joined it and must publish a copy of the job's message (its
--         starter never said it was sent: slow, or dead between its join and its publish; or the job is overdue);
--         past due: how long ago the burst was due when this call joined it (negative: due later; 0: due now, or
--         started now); at: this call's stamp on this node (µs, text)
local KEEP = 16
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local at = t[1] .. string.format('%06d', tonumber(t[2]))
local job = redis.call('HGET', KEYS[1], 'job')
local expires = tonumber(ARGV[9] or '0') or 0
if not job then
  local due = now + tonumber(ARGV[2])
  local hist = cjson.encode({{1, ARGV[1], ARGV[4], due, expires, at}})
  redis.call('HSET', KEYS[1], 'job', ARGV[1], 'first', now, 'due', due, 'seq', 1, 'args', ARGV[4], 'exp', expires,
    'hist', hist, 'sent', '0', 'name', ARGV[6], 'at', now)
  redis.call('PEXPIRE', KEYS[1], due - now + tonumber(ARGV[5]))
  return {1, ARGV[1], due - now, 1, 0, at}
end
local first = tonumber(redis.call('HGET', KEYS[1], 'first'))
local was_due = tonumber(redis.call('HGET', KEYS[1], 'due'))
local due = math.max(was_due, now + tonumber(ARGV[2]))
if tonumber(ARGV[3]) > 0 then
  due = math.max(math.min(due, first + tonumber(ARGV[3])), was_due)
end
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
local raw = redis.call('HGET', KEYS[1], 'hist')
local hist = {}
if raw then hist = cjson.decode(raw) end
hist[#hist + 1] = {seq, ARGV[1], ARGV[4], due, expires, at}
while #hist > KEEP do table.remove(hist, 1) end
redis.call('HSET', KEYS[1], 'due', due, 'args', ARGV[4], 'exp', expires, 'hist', cjson.encode(hist), 'at', now)
redis.call('PEXPIRE', KEYS[1], math.max(due - now, 0) + tonumber(ARGV[5]))
local answer = 0
local sent = tonumber(redis.call('HGET', KEYS[1], 'sent'))
if (sent == 0 and now - first >= tonumber(ARGV[7]))
    or (sent > 0 and now - was_due >= tonumber(ARGV[8]) and now - sent >= tonumber(ARGV[8])) then
  redis.call('HSET', KEYS[1], 'sent', now)
  answer = 2
end
return {answer, job, math.max(due - now, 0), seq, now - was_due, at}
