-- Sliding-window log.
-- KEY   a list of admission times in ms on the Redis clock, newest at the head.
-- p1    limit: entries allowed in any interval of length window
-- p2    window, ms
-- cost  entries one request adds
-- An entry admitted at t counts during [t, t + window). Expired entries are
-- popped from the tail, so the work is proportional to the entries that left
-- the window, never to the limit; LTRIM bounds the list at limit entries.
-- peek returns allowed, remaining, ms, state:
--   allowed: ms until the oldest entry leaves (the reset of RateLimit)
--   denied:  ms until enough entries leave for this request to fit
local function sliding_window_peek(key, now, limit, window, cost)
  local horizon = now - window
  while true do
    local oldest = redis.call('LINDEX', key, -1)
    if not oldest or tonumber(oldest) > horizon then break end
    redis.call('RPOP', key)
  end
  local used = redis.call('LLEN', key)
  if used + cost <= limit then
    local reset = window
    if used > 0 then
      reset = tonumber(redis.call('LINDEX', key, -1)) + window - now
    end
    return true, limit - used - cost, reset, 0
  end
  -- the (used + cost - limit) oldest entries must leave first
  local freeing = tonumber(redis.call('LINDEX', key, limit - used - cost)) or now
  return false, limit - used, freeing + window - now, 0
end

local function sliding_window_commit(key, now, limit, window, cost, _)
  for _ = 1, cost do
    redis.call('LPUSH', key, now)
  end
  redis.call('LTRIM', key, 0, limit - 1)
  redis.call('PEXPIRE', key, window)
end
