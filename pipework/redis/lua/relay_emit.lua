-- A chunk of a streamed job appended to its stream, for the process that reads it
-- (_relay.py); nothing for a job nobody streams (0: its chunks stay in its record).
-- KEYS: the streamed mark, the chunk stream, the job's channel. ARGV: chunk, ttl ms.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', 'c', ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('PUBLISH', KEYS[3], 'c')
return 1
