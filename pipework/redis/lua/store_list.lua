-- The records of the jobs in the indexes named, flat: blob, version, status, updated...
-- KEYS: the active set, then (optionally) the finished sorted set. ARGV: prefix.
local out = {}
for _, key in ipairs(KEYS) do
  local ids
  if redis.call('TYPE', key).ok == 'zset' then ids = redis.call('ZRANGE', key, 0, -1)
  else ids = redis.call('SMEMBERS', key) end
  for _, id in ipairs(ids) do
    local r = redis.call('HMGET', ARGV[1] .. ':job:' .. id, 'd', 'v', 's', 'u')
    if r[1] then
      out[#out + 1] = r[1]; out[#out + 1] = r[2]; out[#out + 1] = r[3]; out[#out + 1] = r[4]
    end
  end
end
return out
