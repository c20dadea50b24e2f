-- Every due suspend timer moved onto the event stream, once (_timers.py).
-- KEYS: the timers' sorted set, the event stream. ARGV: now (score), how many at most, the
-- stream's field. Answers how many it moved.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, event in ipairs(due) do
  redis.call('XADD', KEYS[2], '*', ARGV[3], event)
  redis.call('ZREM', KEYS[1], event)
end
return #due
