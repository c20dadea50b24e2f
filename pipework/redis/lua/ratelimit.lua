-- One request decided on every rate limit it meets, at once (_ratelimit.py): GCRA, with the
-- same rule as pipework/_http/_ratelimit_core.py, in whole microseconds.
-- KEYS: one per limit, its key's TAT. ARGV: now in microseconds ('' : Redis's clock, which
-- every process sharing the server agrees on), then per limit its interval and tolerance.
-- The request passes when no limit's TAT is further ahead of now than its tolerance; then
-- every TAT moves on by its interval (kept until the bucket is full again), else none does.
-- Answers {1 or 0, now, the TAT of each limit after the request}.
local now
if ARGV[1] == '' then
  local clock = redis.call('TIME')
  now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
else
  now = tonumber(ARGV[1])
end
local tats = {}
local allowed = 1
for i = 1, #KEYS do
  local tat = tonumber(redis.call('GET', KEYS[i]) or now)
  if tat < now then tat = now end
  if tat - now > tonumber(ARGV[2 * i + 1]) then allowed = 0 end
  tats[i] = tat
end
if allowed == 1 then
  for i = 1, #KEYS do
    local tat = tats[i] + tonumber(ARGV[2 * i])
    tats[i] = tat
    local ttl = math.max(1, math.ceil((tat - now) / 1000))
    redis.call('SET', KEYS[i], string.format('%d', tat), 'PX', string.format('%d', ttl))
  end
end
local answer = {allowed, now}
for i = 1, #KEYS do answer[i + 2] = tats[i] end
return answer
