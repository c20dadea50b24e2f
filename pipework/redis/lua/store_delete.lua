-- A record dropped whatever its status.
-- KEYS: job, finished. ARGV: id, prefix.
redis.call('SREM', ARGV[2] .. ':active', ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('DEL', KEYS[1])
