-- rate_claim.lua
-- protocol: claim a booked start (docs/protocol.md, Transitions)
-- KEYS[1] - rate key (the sliding log, see rate.lua, rate_book.lua)
-- ARGV[1] - the booking's entry, '<slot>:<owner token>'
-- ARGV[2] - the window, microseconds
-- ARGV[3] - the lateness allowed, microseconds: on time when now - the booked moment <= it
-- ARGV[4] - '1': move the entry where it starts (a second call, once a quorum said it may start); '': only say so
-- ARGV[5] - n, the starts allowed in any window now: a booking of a slot >= n (made before lock_rate was lowered) is
--           not started on (answered {0}: the call books anew under the new n), and an entry of such a slot holds
--           every slot, as in rate_book.lua ('' : the booking's n, no check)
-- A booked call that arrives asks each node whether its moment has come. Before it, or while another entry of its
-- slot (a predecessor that started late, moved to its real start) or an entry that holds no slot (a pause) still
-- covers now: wait. Its moment is its booking's, or the end of such a covering entry if later (its entry moves
-- there). On time (at most ARGV[3] after that moment), it starts there; later, but within a window of its booking:
-- it starts now and its entry moves to now, so the slot's next start waits a window from this real start (that
-- one's claim finds this entry covering its moment: it waits). A window late or more (its slot may be its
-- successor's now): it does not start on it, and books anew.
-- Only a call that will start moves its entry (ARGV[4]): a claim that fails its quorum never pushes its successors.
-- returns {1, where it starts (µs), now, 1 if its entry must move there} when it may start here; {2, µs to wait} when early or covered;
--         {3} when a window late; {0} when the entry is not here (lost, expired or undone)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window, late = tonumber(ARGV[2]), tonumber(ARGV[3])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then
  return {0}
end
score = tonumber(score)
local slot = string.match(ARGV[1], '^(%d+):')
local n = tonumber(ARGV[5])
if n and tonumber(slot) >= n then
  return {0}
end
if score > now then
  return {2, score - now}
end
if score <= now - window then
  return {3}
end
-- The entries of its slot that began after its predecessor's booked place, up to now: a predecessor that started
-- late (moved; its successors, booked a window on, are later than now). And those holding no slot, whenever they
-- begin: a pause longer than the window is stored in the future (it ends when they leave the window); so do those
-- of a slot >= n (n lowered: bookings made before, undone when claimed, and starts). Its moment
-- is the latest end of them: before it, wait; after it, on time or late.
local due = score
local near = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. string.format('%.0f', score - window), '+inf', 'WITHSCORES')
for i = 1, #near, 2 do
  if near[i] ~= ARGV[1] then
    local s = string.match(near[i], '^(%d+):')
    local at = tonumber(near[i + 1])
    if not s or (n and tonumber(s) >= n) or (s == slot and at <= now) then
      due = math.max(due, at + window)
    end
  end
end
if due > now then
  return {2, due - now}
end
if now - due > late then
  due = now
end
if due ~= score and ARGV[4] == '1' then
  redis.call('ZADD', KEYS[1], 'XX', string.format('%.0f', due), ARGV[1])
  score = due
  -- The log lives until the moved entry leaves the window (extended, never shortened: the booking's own expiry ran
  -- from its booked moment, up to a window earlier).
  local ttl = math.ceil((due + window - now) / 1000) + 1000
  if redis.call('PTTL', KEYS[1]) < ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
end
return {1, due, now, due ~= score and 1 or 0}
