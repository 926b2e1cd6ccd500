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
--
-- Within one script call, a key's length and oldest entry are remembered
-- for the same `now` (a batch shares one TIME), so the second and later
-- requests on a hot key cost an LPUSH and a PEXPIRE, not a re-read.
local sliding_seen = {}

local function sliding_window_peek(key, now, limit, window, cost)
  local seen = sliding_seen[key]
  local used, oldest
  if seen and seen.now == now then
    used, oldest = seen.used, seen.oldest
  else
    local horizon = now - window
    oldest = redis.call('LINDEX', key, -1)
    while oldest and tonumber(oldest) <= horizon do
      redis.call('RPOP', key)
      oldest = redis.call('LINDEX', key, -1)
    end
    used = 0
    if oldest then
      oldest = tonumber(oldest)
      used = redis.call('LLEN', key)
      if used > limit then
        -- The limit was lowered by a reload: keep the list bounded by it.
        redis.call('LTRIM', key, 0, limit - 1)
        used = limit
        oldest = tonumber(redis.call('LINDEX', key, -1))
      end
    end
    seen = { now = now, used = used, oldest = oldest }
    sliding_seen[key] = seen
  end
  if used + cost <= limit then
    return true, limit - used - cost, (oldest or now) + window - now, seen
  end
  -- the (used + cost - limit) oldest entries must leave first
  local freeing = tonumber(redis.call('LINDEX', key, limit - used - cost)) or now
  return false, limit - used, freeing + window - now, seen
end

-- Admission leaves at most `limit` entries (peek admits only when they fit),
-- so the list needs no trimming here. PEXPIRE drops an idle key: once per
-- key and `now` is enough, as every entry pushed at `now` expires together.
local function sliding_window_commit(key, now, _, window, cost, seen)
  for _ = 1, cost do
    redis.call('LPUSH', key, now)
  end
  if seen.expires ~= now then
    redis.call('PEXPIRE', key, window)
    seen.expires = now
  end
  seen.used = seen.used + cost
  seen.oldest = seen.oldest or now
end
