-- A write to a push board (_backplane.py), checked against the shared state: its version is
-- the board's offset counted up here, and the change goes on the board's log.
-- KEYS: meta, state, log. ARGV: op, resource, state (JSON), max_resources, log_length.
-- Answers {'ok', epoch, offset}, or why not: {'exists'}, {'missing'}, {'full', held},
-- {'unseeded'} (the board is being restored).
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if not epoch then return {'unseeded'} end
local op, resource = ARGV[1], ARGV[2]
local exists = redis.call('HEXISTS', KEYS[2], resource) == 1
if op == 'create' then
  if exists then return {'exists'} end
  local held = redis.call('HLEN', KEYS[2])
  if held >= tonumber(ARGV[4]) then return {'full', tostring(held)} end
elseif not exists then
  return {'missing'}
end
local offset = redis.call('HINCRBY', KEYS[1], 'offset', 1)
if op == 'delete' then
  redis.call('HDEL', KEYS[2], resource)
else
  redis.call('HSET', KEYS[2], resource, '[' .. offset .. ',' .. ARGV[3] .. ']')
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*',
  'e', epoch, 'v', offset, 'op', op, 'r', resource, 'd', ARGV[3])
return {'ok', epoch, tostring(offset)}
