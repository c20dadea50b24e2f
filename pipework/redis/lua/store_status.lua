-- A write of the status alone (and updated_at, kept in u until the next whole write), for
-- a record otherwise as it was read at that version: its blob is left as it is. A record
-- written since is refused (-3), and written whole by the caller. Answers as
-- store_update.lua does.
-- KEYS: job. ARGV: status (not terminal), updated_at, id, prefix, the version the record
-- must still have ("=" before it: sent again after its round trip failed; a record that
-- holds this status and updated_at already was written by the first, and its version is
-- the answer).
--
-- The terminal statuses (pipework.dispatcher's TERMINAL; _store.py checks the table).
local terminal = {['cancelled'] = true, ['done'] = true, ['expired'] = true, ['failed'] = true}
local cur = redis.call('HMGET', KEYS[1], 's', 'v', 'u')
if not cur[1] then return -1 end
if terminal[cur[1]] then return -2 end
local expected = ARGV[5]
if string.byte(expected) == 61 then -- '=': sent again
  if cur[1] == ARGV[1] and cur[3] == ARGV[2] then return tonumber(cur[2]) end
  expected = string.sub(expected, 2)
end
if tonumber(cur[2]) ~= tonumber(expected) then return -3 end
local v = tonumber(cur[2]) + 1
local p = ARGV[4]
redis.call('HSET', KEYS[1], 's', ARGV[1], 'v', v, 'u', ARGV[2])
if redis.call('EXISTS', p .. ':watch:' .. ARGV[3]) == 1 then
  redis.call('PUBLISH', p .. ':relay:' .. ARGV[3], v)
end
return v
