-- A job's record created (_store.py), never over an existing one (0 then; but a create
-- sent again after its round trip failed, its version with "=" before it, finds the record
-- it wrote with this very blob and answers as if it created it now: 1, or {"", {}} for a
-- claim, whose entries the first read left pending, to be claimed after the idle time).
-- KEYS: job, the active set, then optionally a stream. ARGV: blob, status, version, id,
-- origin, the job's owner and its creation time (wall clock; "" and "" for no owner: else
-- the id goes in {prefix}:owner:{owner} scored by that time, and the owner in the record's
-- field n, for the scripts that drop the record to take the id out of that index), then
-- (with the stream) an entry's field and value: the job's first event, written
-- with its record (see RedisEventQueue.create_and_submit); then, to claim it, the group, the
-- consumer, how many entries it may read, and the record's updated_at. A claim reads the
-- group's next entries for the consumer, as its XREADGROUP would (they are pending for it
-- from then on); if the job's own event is among them, its record is marked running (its
-- creator holds a worker slot for its first step) and the answer is {its entry id, the
-- entries}, else {"", the entries}, the record left queued. A read the group refuses
-- (NOGROUP: Redis restarted empty) claims nothing: what was written stays written.
local version = ARGV[3]
local again = string.byte(version) == 61 -- '=': sent again
if again then version = string.sub(version, 2) end
if redis.call('EXISTS', KEYS[1]) == 1 then
  if again and redis.call('HGET', KEYS[1], 'd') == ARGV[1] then
    if ARGV[10] then return {'', {}} end
    return 1
  end
  return 0
end
redis.call('HSET', KEYS[1], 'd', ARGV[1], 's', ARGV[2], 'v', version, 'o', ARGV[5])
redis.call('SADD', KEYS[2], ARGV[4])
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'n', ARGV[6])
  -- KEYS[2] is {prefix}:active.
  redis.call('ZADD', string.sub(KEYS[2], 1, -7) .. 'owner:' .. ARGV[6], ARGV[7], ARGV[4])
end
if not KEYS[3] then return 1 end
local at = redis.call('XADD', KEYS[3], '*', ARGV[8], ARGV[9])
if not ARGV[10] then return 1 end
local read = redis.pcall('XREADGROUP', 'GROUP', ARGV[10], ARGV[11], 'COUNT', ARGV[12],
    'STREAMS', KEYS[3], '>')
if type(read) ~= 'table' or read.err or not read[1] then return {'', {}} end
local entries = read[1][2]
for _, entry in ipairs(entries) do
    if entry[1] == at then
        redis.call('HSET', KEYS[1], 's', 'running', 'u', ARGV[13])
        return {at, entries}
    end
end
return {'', entries}
