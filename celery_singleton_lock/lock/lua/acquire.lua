-- acquire.lua
-- protocol: acquire, reserve, take over, refuse, done, claim, end a killed run, free a reservation (docs/protocol.md, Transitions)
-- KEYS[1] - lock key: a hash, the holder record (owner, fence, and the fields of ARGV[7..]); slot 0 of a limit
-- KEYS[2] - fencing counter key (never expires)
-- KEYS[3..m+1] - the other slots of a lock with a limit of n (ARGV[6]), and up to m: each one holder record, like
--           KEYS[1]; slots n+1..m (a limit that was higher when this job may have taken a slot) are only looked at
--           for this job's own record, never taken
-- KEYS[m+2] - optional: the done marker of this job (present when a run of the job finished, see FINISH_SCRIPT)
-- ARGV[1] - owner token, fresh for every attempt
-- ARGV[2] - lease in milliseconds
-- ARGV[3] - '1' to bump the fencing counter, '0' for a lock without fencing tokens (no counter key is created)
-- ARGV[4] - the owner token of a record we may take over (handed over to us, see TRANSFER_SCRIPT), or ''
-- ARGV[5] - this job's id, or '': a refusal by a holder of the same job marks that record 'waiting' (unless the
--           record is 'open': handed over for this job to take over, so the refused attempt is the job's own)
-- ARGV[6] - n, the number of slots (the limit; 1 for a plain lock), or 'n/m': look at m slots for this job's own
-- ARGV[7..] - field, value pairs of our holder record
-- A slot is taken in this order: the one holding our token or the token we may take over; else, when a slot is
-- held by this same job, none (refused by that holder: a job never holds two slots); else the first free one.
-- returns {ACQUIRED, fencing token (0 without fencing), slot index (0-based)} when the lease is ours (new, or
--          taken over); with a limit, and a free slot taken, a 4th element: the other slots' owners as below
--          ('0:' for a free slot), which tell a contender that fails its quorum whether the limit is reached;
--         {HELD, the holder's owner, job, state, try and worker fields, each as '<length>:<value>' ('' for a key
--          that is not a record), remaining ms}: one bulk string, not the whole record (a refusal is a duplicate's
--          hot path, and parsing a reply costs per element); with a limit, the holder of this job's slot or else of
--          the lowest busy slot; with a limit and every slot busy, a 4th element: each slot's owner in slot
--          order, as '<length>:<value>' ('#' for a key that is not a record), so the client can tell a limit
--          reached on a quorum of the nodes from contenders that split the free slots;
--         {DONE} when the done marker exists: this job already finished (nothing is changed)
-- A record taken over is kept in our record's '_prev' field (its fields and its expiry, absolute ms), so that
-- UNDO_SCRIPT can put it back if this attempt fails its quorum.
-- A plain lock (one slot, ARGV[6] '1', no done marker) looks at its key once, with TYPE: free, it is taken at once
-- (the general path below does the same steps, with nothing to look at after them); held, that look is not repeated
-- below (a refusal, a duplicate's hot path, then costs TYPE, HMGET and PTTL).
local first = nil
if ARGV[6] == '1' and #KEYS == 2 then
  first = redis.call('TYPE', KEYS[1]).ok
  if first == 'none' then
    local fence, text = 0, '0'
    if ARGV[3] == '1' then
      fence = redis.call('INCR', KEYS[2])
      text = string.format('%d', fence)
    end
    redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', text, unpack(ARGV, 7))
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, fence, 0}
  end
end
local n = tonumber(ARGV[6])
local m = n
if not n then  -- 'n/m' (a pattern match only then: a plain lock's hot path skips it)
  n, m = string.match(ARGV[6], '^(%d+)/(%d+)$')
  n, m = tonumber(n), tonumber(m)
end
if #KEYS > m + 1 and redis.call('EXISTS', KEYS[m + 2]) == 1 then
  return {2}
end
-- A refusal's reply: the brief (owner, job, state, try, worker) of the record under k, or '' for a foreign key.
local function refusal(k, brief, owners)
  local text = ''
  if brief then
    local out = {}
    for i = 1, 5 do
      local v = brief[i] or ''
      out[i] = string.format('%d:', #v) .. v
    end
    text = table.concat(out)
  end
  if owners then
    return {0, text, redis.call('PTTL', k), table.concat(owners)}
  end
  return {0, text, redis.call('PTTL', k)}
end
local key, slot, owner, busy, busy_brief = nil, 0, nil, nil, nil
local owners = n > 1 and {} or nil
for s = 1, m do
  local k = KEYS[s == 1 and 1 or s + 1]
  local within = s <= n
  local kind = s == 1 and first or redis.call('TYPE', k).ok
  if kind == 'none' then
    if within and not key then
      key, slot = k, s - 1
    end
    if within and owners then
      owners[s] = '0:'
    end
  elseif kind ~= 'hash' then
    if within then
      busy = busy or k
      if owners then
        owners[s] = '1:#'
      end
    end
  else
    local brief = redis.call('HMGET', k, 'owner', 'job', 'state', 'try', 'worker', 'open')
    if within and owners then
      local o = brief[1] or ''
      owners[s] = string.format('%d:', #o) .. o
    end
    if brief[1] == ARGV[1] or (ARGV[4] ~= '' and brief[1] == ARGV[4]) then
      key, slot, owner = k, s - 1, brief[1]
      break
    end
    if ARGV[5] ~= '' and brief[2] == ARGV[5] then
      if brief[6] ~= '1' then
        redis.call('HSET', k, 'waiting', '1')
      end
      return refusal(k, brief)
    end
    if within and not busy then
      busy, busy_brief = k, brief
    end
  end
end
if not key then
  return refusal(busy, busy_brief, owners)
end
local waiting, prev = false, false
if owner then
  if owner ~= ARGV[1] then
    local now = redis.call('TIME')
    local all, fields = redis.call('HGETALL', key), {}
    for i = 1, #all, 2 do
      if all[i] ~= '_prev' then  -- one level: an undo restores only the record it replaced
        fields[#fields + 1] = all[i]
        fields[#fields + 1] = all[i + 1]
      end
    end
    local expires = now[1] * 1000 + math.floor(now[2] / 1000) + redis.call('PTTL', key)
    prev = cjson.encode({fields, expires})
  end
  -- taken over: a copy of the job known to wait for it still waits for us
  waiting = redis.call('HGET', key, 'waiting')
  redis.call('DEL', key)
end
local fence, text = 0, '0'
if ARGV[3] == '1' then
  fence = redis.call('INCR', KEYS[2])
  text = string.format('%d', fence)
end
redis.call('HSET', key, 'owner', ARGV[1], 'fence', text, unpack(ARGV, 7))
if waiting then
  redis.call('HSET', key, 'waiting', waiting)
end
if prev then
  redis.call('HSET', key, '_prev', prev)
end
redis.call('PEXPIRE', key, ARGV[2])
if owners and not owner then
  return {1, fence, slot, table.concat(owners)}
end
return {1, fence, slot}
