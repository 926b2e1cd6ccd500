-- Fixed window counter.
-- KEY   a string counter; its TTL is what is left of the window.
-- p1    limit: units allowed in one window
-- p2    window, ms; it opens at the first allowed request for the key
-- cost  units one request takes
-- peek returns allowed, remaining, ms until the window closes, state (used).
local function fixed_window_peek(key, _, limit, window, cost)
  local ttl = redis.call('PTTL', key)
  local used = 0
  if ttl > 0 then
    used = tonumber(redis.call('GET', key)) or 0
  else
    ttl = window
  end
  if used + cost <= limit then
    return true, limit - used - cost, ttl, used
  end
  return false, limit - used, ttl, used
end

local function fixed_window_commit(key, _, _, window, cost, used)
  if used == 0 then
    redis.call('SET', key, cost, 'PX', window)
  else
    redis.call('INCRBY', key, cost)
  end
end
