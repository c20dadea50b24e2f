-- A job's record written whole (_store.py). Answers one integer: the new version (1 or
-- more) once written; -1 no such record, -2 a finished record a non-terminal write may not
-- change, -3 written since at another version (nothing written); -10 - v a finished record
-- at version v that a terminal write leaves as it is.
-- KEYS: job, finished, gone (the tombstones' hash). ARGV: blob, status, id, terminal
-- (0/1), retain_until (wall clock), token hash, then what every call of a store sends
-- alike: prefix, record ttl ms, retain seconds, retain count, the writer's origin,
-- remember-gone seconds, remember-gone count (see RedisJobStore._tail), and last the
-- version the record must still have ("" for any; "=" before it, or alone, for a write
-- sent again after its round trip failed: if the record holds this very blob, the first
-- one was written, and nothing more is done: its version is the answer, as if written
-- now); then optionally (a fourth key, a
-- stream) an entry's field and value, added once the record is written (the job's next
-- event, see RedisEventQueue.update_and_put). An end is published only if someone
-- elsewhere may wait for it: the job came from another process (its origin), or a process
-- that did not create it waits for it (the field w).
--
-- Finished records dropped beyond retain count leave their owner's index
-- ({prefix}:owner:{owner}, the owner in the record's field n) with them; the end of an
-- owned job also takes out of its owner's index the oldest ids whose records are gone.
--
-- An end writes the job's tombstone (its token hash in gone, and its id in
-- {prefix}:remembered scored by when its retention ends, as in finished), forgets at most
-- 8 tombstones whose time has come (remember-gone seconds after their retention ended),
-- and keeps at most remember-gone count tombstones beyond the finished records kept (the
-- oldest go first).
--
-- The terminal statuses (pipework.dispatcher's TERMINAL; _store.py checks the table).
local terminal = {['cancelled'] = true, ['done'] = true, ['expired'] = true, ['failed'] = true}
local cur = redis.call('HMGET', KEYS[1], 's', 'v', 'o', 'w', 'n')
if not cur[1] then return -1 end
local expected = ARGV[14]
if string.byte(expected) == 61 then -- '=': sent again
  if redis.call('HGET', KEYS[1], 'd') == ARGV[1] then return tonumber(cur[2]) end
  expected = string.sub(expected, 2)
end
if terminal[cur[1]] then
  if ARGV[4] == '1' then return -10 - tonumber(cur[2]) end
  return -2
end
if expected ~= '' and tonumber(cur[2]) ~= tonumber(expected) then
  return -3
end
local v = tonumber(cur[2]) + 1
local p = ARGV[7]
redis.call('HSET', KEYS[1], 'd', ARGV[1], 's', ARGV[2], 'v', v, 'u', '')
if redis.call('EXISTS', p .. ':watch:' .. ARGV[3]) == 1 then
  redis.call('PUBLISH', p .. ':relay:' .. ARGV[3], v)
end
if ARGV[4] == '1' then
  redis.call('SREM', p .. ':active', ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[8])
  redis.call('ZADD', KEYS[2], ARGV[5], ARGV[3])
  if cur[3] ~= ARGV[11] or cur[4] then redis.call('PUBLISH', p .. ':finished', ARGV[3]) end
  local kept = redis.call('ZCARD', KEYS[2])
  local extra = kept - tonumber(ARGV[10])
  if extra > 0 then
    local old = redis.call('ZPOPMIN', KEYS[2], extra)
    for i = 1, #old, 2 do
      -- Out of its owner's index with it (the owner, if any, is the record's n).
      local key = p .. ':job:' .. old[i]
      local owner = redis.call('HGET', key, 'n')
      if owner then redis.call('ZREM', p .. ':owner:' .. owner, old[i]) end
      redis.call('DEL', key)
    end
    kept = kept - extra
  end
  local remember = tonumber(ARGV[13])
  local remembered = p .. ':remembered'
  if remember > 0 then
    redis.call('HSET', KEYS[3], ARGV[3], ARGV[6])
    redis.call('ZADD', remembered, ARGV[5], ARGV[3])
  end
  -- Now is its retention's end less the retention; forgotten, what ended before that less
  -- the time ids are remembered.
  local since = tonumber(ARGV[5]) - tonumber(ARGV[9]) - tonumber(ARGV[12])
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', remembered, '-inf', since, 'LIMIT', 0, 8)) do
    redis.call('HDEL', KEYS[3], id)
    redis.call('ZREM', remembered, id)
  end
  extra = redis.call('ZCARD', remembered) - kept - remember
  if extra > 0 then
    local old = redis.call('ZPOPMIN', remembered, extra)
    for i = 1, #old, 2 do redis.call('HDEL', KEYS[3], old[i]) end
  end
  if cur[5] then
    -- The owner's 8 oldest ids whose records are gone (dropped by their TTL, unread) leave
    -- the owner's index: it holds no more than the owner's records kept, and a few.
    local index = p .. ':owner:' .. cur[5]
    for _, id in ipairs(redis.call('ZRANGE', index, 0, 7)) do
      if redis.call('EXISTS', p .. ':job:' .. id) == 0 then redis.call('ZREM', index, id) end
    end
  end
end
if KEYS[4] then redis.call('XADD', KEYS[4], '*', ARGV[15], ARGV[16]) end
return v
