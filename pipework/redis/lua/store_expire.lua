-- Finished records past their time dropped (and taken out of their owner's index);
-- tombstones past theirs forgotten, and the
-- oldest beyond the remembered count (counted beyond the finished records kept), as an
-- end does (store_update.lua).
-- KEYS: finished, gone (the tombstones' hash), remembered (their ids by when their
-- retention ended). ARGV: now (wall clock), prefix, remember-gone seconds, remember-gone
-- count, and optionally a job id. Answers how many records were dropped; with an id, its
-- tombstone once that is done (the owner-token hash, "" for none), or nil if it is not
-- remembered.
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, id in ipairs(old) do
  -- Out of its owner's index with it (the owner, if any, is the record's n).
  local key = ARGV[2] .. ':job:' .. id
  local owner = redis.call('HGET', key, 'n')
  if owner then redis.call('ZREM', ARGV[2] .. ':owner:' .. owner, id) end
  redis.call('DEL', key)
end
if #old > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1]) end
local since = tonumber(ARGV[1]) - tonumber(ARGV[3])
local forgotten = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', since)
for _, id in ipairs(forgotten) do redis.call('HDEL', KEYS[2], id) end
if #forgotten > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', since) end
local extra = redis.call('ZCARD', KEYS[3]) - redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[4])
if extra > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[3], extra)
  for i = 1, #popped, 2 do redis.call('HDEL', KEYS[2], popped[i]) end
end
if ARGV[5] then return redis.call('HGET', KEYS[2], ARGV[5]) end
return #old
