-- The floor that floodgate's sliding-window script is measured against
-- (`reference_async cost`, driven by scripts/bench): the plain
-- sliding-window log, a list of admission times per key, newest first,
-- kept at most `limit` long. Nothing else: no operator records, no
-- deadlines, no error isolation, no exact remaining count, no wait, no
-- clock that steps back, no cost above 1.
--
-- KEYS  one key per job
-- ARGV  [1] number of jobs, then per job: now in ms ("" = Redis TIME),
--       limit, window in ms
-- Returns one value per job: 1 allowed, 0 denied.
--
-- A request is allowed when the list holds fewer than `limit` entries, or
-- when its limit-th entry has left the window; it is then pushed, the list
-- is trimmed to `limit` entries, and the key lives one window.
local time = redis.call('TIME')
local clock = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local out = {}
local a = 2
for j = 1, tonumber(ARGV[1]) do
  local key = KEYS[j]
  local now = tonumber(ARGV[a]) or clock
  local limit, window = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local allowed = redis.call('LLEN', key) < limit
  if not allowed then
    allowed = tonumber(redis.call('LINDEX', key, limit - 1)) <= now - window
  end
  if allowed then
    redis.call('LPUSH', key, now)
    redis.call('LTRIM', key, 0, limit - 1)
    redis.call('PEXPIRE', key, window)
    out[j] = 1
  else
    out[j] = 0
  end
  a = a + 3
end
return out
