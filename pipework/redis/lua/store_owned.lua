-- A page of an owner's jobs, newest first (RedisJobStore.owned): the records of the ids in
-- the owner's index ({prefix}:owner:{owner}, scored by creation time) below a bound, flat
-- as store_list.lua answers them (blob, version, status, updated...), then the score of the
-- last id looked at, or "" when the index holds nothing beyond this page. An id whose
-- record is gone (dropped by its Redis TTL, unread) leaves the index here.
-- KEYS: the owner's index. ARGV: prefix, the bound ("+inf", or "(" and a score: below
-- it), how many ids to look at.
local found = redis.call('ZREVRANGEBYSCORE', KEYS[1], ARGV[2], '-inf', 'WITHSCORES',
    'LIMIT', 0, ARGV[3])
local out = {}
local last = ''
for i = 1, #found, 2 do
  local id = found[i]
  last = found[i + 1]
  local r = redis.call('HMGET', ARGV[1] .. ':job:' .. id, 'd', 'v', 's', 'u')
  if r[1] then
    out[#out + 1] = r[1]; out[#out + 1] = r[2]; out[#out + 1] = r[3]; out[#out + 1] = r[4]
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
if #found < 2 * tonumber(ARGV[3]) then last = '' end
out[#out + 1] = last
return out
