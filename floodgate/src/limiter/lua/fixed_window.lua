-- Fixed window counter.
-- KEY   a hash {start, used, window}: the window opened at `start` (ms) with
--       `used` units taken, under a window of `window` ms.
-- p1    limit: units allowed in one window
-- p2    window, ms; it opens at the first allowed request for the key
-- cost  units one request takes
--
-- The stored window is the one in force when the key was last decided: the
-- key expires when that window closes, and until the key's next decision
-- that is when it closes. The next decision applies the window in force
-- from then on: a window still open under both closes at start + the new
-- window (so a shorter one may have closed already), and the key is
-- stamped with the new window and its TTL. A lowered or raised limit
-- applies to the units already used at once.
-- peek returns allowed, remaining, ms until the window closes, state.
define(2, 'hash', 'start', function()
  local FIXED_WINDOW_FIELDS = { 'start', 'used', 'window' }

  local function fixed_window_peek(key, now, limit, window, cost)
    forget(key)
    local h = hash_read(key, 2, FIXED_WINDOW_FIELDS)
    local s = { start = now, used = 0, closes = now + window }
    if h[1] or h[2] then
      local start, used = stored(h[1]), stored(h[2])
      local was = window
      if h[3] then
        was = stored(h[3])
      end
      local now_eff = math.max(now, start)
      if now_eff < start + was and now_eff < start + window then
        s.start, s.used, s.closes = start, used, start + window
        if was ~= window and not READ_ONLY then
          redis.call('HSET', key, 'window', window)
          set_ttl(key, s.closes - now)
        end
      end
    end
    local wait = s.closes - now
    if s.used + cost <= limit then
      return true, limit - s.used - cost, wait, s
    end
    return false, limit - s.used, wait, s
  end

  local function fixed_window_commit(key, now, _, window, cost, s)
    redis.call('HSET', key, 'start', s.start, 'used', s.used + cost, 'window', window)
    set_ttl(key, s.closes - now)
  end

  -- A counter written before windows stored their start (a plain integer
  -- with a TTL): the window keeps its closing time.
  local function fixed_window_adopt(key, now, window)
    local used = tonumber(redis.call('GET', key))
    local ttl = redis.call('PTTL', key)
    if READ_ONLY then
      -- Peek: what the key would hold after the adoption, read from here on.
      READ_ONLY[key] = {}
      if used and ttl > 0 then
        READ_ONLY[key] = { math.min(now, now + ttl - window), used, window }
      end
      return
    end
    redis.call('DEL', key)
    if used and ttl > 0 then
      local start = math.min(now, now + ttl - window)
      redis.call('HSET', key, 'start', start, 'used', used, 'window', window)
      set_ttl(key, start + window - now)
    end
  end

  -- Give-back: `used` goes down, never below 0, and only while the window
  -- the request was charged in is still open.
  local function fixed_window_give_back(key, now, _, p2, cost)
    local h = redis.call('HMGET', key, 'start', 'used', 'window')
    if not (h[1] and h[2]) then
      return 0
    end
    local start, used = stored(h[1]), stored(h[2])
    local window = p2
    if h[3] then
      window = stored(h[3])
    end
    if math.max(now, start) >= start + window then
      return 0
    end
    return hash_give_back(key, 'used', used, cost)
  end

  return {
    valid = window_valid(MAX_LIMIT),
    peek = fixed_window_peek,
    commit = fixed_window_commit,
    give_back = fixed_window_give_back,
    quota = window_quota,
    override = window_override(MAX_LIMIT),
    adopt = fixed_window_adopt,
  }
end)
