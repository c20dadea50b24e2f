-- The record for a waiter (Engine.wait) in a process that may not hear of the job's end
-- otherwise: marked so that its end is published (see store_update.lua).
-- KEYS: job. Answers {blob, version, false, status, updated}, or {} for no record (the
-- caller then asks whether the id is remembered as gone, store_expire.lua).
--
-- The terminal statuses (pipework.dispatcher's TERMINAL; _store.py checks the table).
local terminal = {['cancelled'] = true, ['done'] = true, ['expired'] = true, ['failed'] = true}
local r = redis.call('HMGET', KEYS[1], 'd', 'v', 's', 'u')
if r[1] then
  if not terminal[r[3]] then redis.call('HSET', KEYS[1], 'w', '1') end
  return {r[1], r[2], false, r[3], r[4]}
end
return {}
