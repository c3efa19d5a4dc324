-- count.lua
-- protocol: count (docs/protocol.md, Transitions)
-- KEYS[1] - a counts hash (<prefix>stats, <prefix>stats:total or <prefix>stats:m:<minute>)
-- KEYS[2] - the batch's marker beside it: sibling_key(KEYS[1], ':batch:' .. batch id)
-- ARGV[1] - the marker's life in s (longer than the flusher retries a batch)
-- ARGV[2] - the hash's life in s (0: the hash keeps no expiry)
-- ARGV[3..] - field, increment pairs
-- returns 1 when the batch was added now, 0 when its marker was there already (a retried batch: added once)
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
for i = 3, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
if tonumber(ARGV[2]) > 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 1
