-- A record dropped whatever its status, and its tombstone with it: a deleted job is
-- unknown, not gone; and out of its owner's index.
-- KEYS: job, finished. ARGV: id, prefix.
redis.call('SREM', ARGV[2] .. ':active', ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', ARGV[2] .. ':gone', ARGV[1])
redis.call('ZREM', ARGV[2] .. ':remembered', ARGV[1])
local owner = redis.call('HGET', KEYS[1], 'n')
if owner then redis.call('ZREM', ARGV[2] .. ':owner:' .. owner, ARGV[1]) end
return redis.call('DEL', KEYS[1])
