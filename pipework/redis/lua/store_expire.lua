-- Finished records past their time dropped.
-- KEYS: finished. ARGV: now (wall clock), prefix.
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, id in ipairs(old) do redis.call('DEL', ARGV[2] .. ':job:' .. id) end
if #old > 0 then redis.call('ZREM', KEYS[1], unpack(old)) end
return #old
