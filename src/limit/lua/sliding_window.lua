-- Sliding-window log.
-- KEY   a list of admission times in ms on the Redis clock, newest at the head.
-- p1    limit: entries allowed in any interval of length window
-- p2    window, ms
-- cost  entries one request adds
-- An entry admitted at t counts during [t, t + window). Expired entries are
-- popped from the tail, so the work is proportional to the entries that left
-- the window, never to the limit (no LRANGE).
-- peek returns allowed, remaining, ms, state:
--   allowed: ms until the oldest entry leaves (the reset of RateLimit)
--   denied:  ms until enough entries leave for this request to fit
local function sliding_window_peek(key, now, limit, window, cost)
  local horizon = now - window
  local oldest = redis.call('LINDEX', key, -1)
  while oldest and tonumber(oldest) <= horizon do
    redis.call('RPOP', key)
    oldest = redis.call('LINDEX', key, -1)
  end
  if not oldest then
    return cost <= limit, limit - cost, window, 0
  end
  local used = redis.call('LLEN', key)
  if used > limit then
    -- The limit was lowered by a reload: keep the list bounded by it.
    redis.call('LTRIM', key, 0, limit - 1)
    used = limit
    oldest = redis.call('LINDEX', key, -1)
  end
  if used + cost <= limit then
    return true, limit - used - cost, tonumber(oldest) + window - now, 0
  end
  -- the (used + cost - limit) oldest entries must leave first
  local freeing = tonumber(redis.call('LINDEX', key, limit - used - cost)) or now
  return false, limit - used, freeing + window - now, 0
end

-- Admission leaves at most `limit` entries (peek admits only when they fit),
-- so the list needs no trimming here; PEXPIRE drops an idle key.
local function sliding_window_commit(key, now, _, window, cost, _)
  for _ = 1, cost do
    redis.call('LPUSH', key, now)
  end
  redis.call('PEXPIRE', key, window)
end
