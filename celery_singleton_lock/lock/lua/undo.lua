-- undo.lua
-- protocol: undo (docs/protocol.md, Transitions)
-- KEYS - lock keys (holder records): the slots of the lock (one for a plain lock)
-- ARGV[1] - owner token of a failed attempt
-- returns 1 when a record was that attempt's: it is deleted, and a record the attempt had taken over is put back
--   (with its own expiry, if it has not passed); 0 when none was (all left alone)
local undone = 0
for _, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'owner') == ARGV[1] then
    local prev = redis.call('HGET', key, '_prev')
    redis.call('DEL', key)
    if prev then
      local p = cjson.decode(prev)
      local now = redis.call('TIME')
      local left = p[2] - (now[1] * 1000 + math.floor(now[2] / 1000))
      if left > 0 and #p[1] > 0 then
        redis.call('HSET', key, unpack(p[1]))
        redis.call('PEXPIRE', key, left)
      end
    end
    undone = 1
  end
end
return undone
