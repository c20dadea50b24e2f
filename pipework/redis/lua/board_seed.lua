-- A board's shared state written from one process's copy (_backplane.py), only if the board
-- has none: the first process to find it missing writes its copy.
-- KEYS: meta, state. ARGV: epoch, offset, then resource, [offset, state] pairs.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'offset', ARGV[2])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
return 1
