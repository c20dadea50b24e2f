-- The push board's state, for a process that loads it (_backplane.py).
-- KEYS: meta, state, log. The board's epoch, offset, last log entry and state, at once;
-- false if the board has no shared state.
local meta = redis.call('HMGET', KEYS[1], 'epoch', 'offset')
if not meta[1] then return false end
local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
local id = '0-0'
if #last > 0 then id = last[1][1] end
return {meta[1], meta[2], id, redis.call('HGETALL', KEYS[2])}
