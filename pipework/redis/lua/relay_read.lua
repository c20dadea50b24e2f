-- A streamed job's chunks after the last one read (_relay.py).
-- KEYS: the chunk stream. ARGV: the last entry read, how many. Entries after it, flat:
-- id, chunk, id, chunk...
local out = {}
for _, e in ipairs(redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])) do
  out[#out + 1] = e[1]; out[#out + 1] = e[2][2]
end
return out
