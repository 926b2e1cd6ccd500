-- Sliding-window log.
-- KEY   a list of admission times in ms, newest at the head (one entry per unit).
-- p1    limit: units allowed in any interval of length window (<= MAX_LIMIT)
-- p2    window, ms
-- cost  units one request takes
-- An entry admitted at t counts during [t, t + window).
--
-- Entries are dropped only once they are out of the window in force, never
-- to fit a limit: a lowered limit denies until enough entries leave, and a
-- limit raised again finds them all. Admission needs used + cost <= limit,
-- so the list never holds more than the largest limit in force (MAX_LIMIT).
--
-- Time: the state's own time is its newest entry, and a decision's clock is
-- now_eff = max(now, newest), so a clock that steps back meets the entries
-- it made room with. Entries are pushed at now_eff (the list stays
-- newest-first) and expired entries are dropped only by an admission, when
-- the state's time moves to now_eff: a denial drops nothing that an earlier
-- clock would still count.
--
-- Work: entries live at now_eff are found by binary search with LINDEX
-- (the list is sorted) and dropped with one LTRIM, so a decision costs
-- O(log n) list reads whatever the limit and however many entries leave at
-- once; only a request's own units cost one entry each.
--
-- The key lives until its newest entry leaves the window in force at the
-- last decision: every decision on a live key sets its TTL again, so a
-- window made longer by a reload keeps the log long enough.
--
-- peek returns allowed, remaining, ms, state:
--   allowed: ms until the oldest entry leaves (the reset of RateLimit)
--   denied:  ms until enough entries leave for this request to fit
local PUSH_CHUNK = 1000

-- The state at now_eff: `len` entries, of which the first `used` (from the
-- head) are in the window.
local function sliding_window_read(key, now, limit, window)
  local s = { alg = 1, now = now, limit = limit, window = window, used = 0, len = 0, now_eff = now }
  if READ_ONLY and READ_ONLY[key] then
    return s
  end
  local head = redis.call('LINDEX', key, 0)
  if not head then
    return s
  end
  local newest = stored(head)
  local now_eff = math.max(now, newest)
  local horizon = now_eff - window
  local n = redis.call('LLEN', key)
  if n > MAX_LIMIT then
    -- Only a list this code did not write: no limit can look past MAX_LIMIT entries.
    if not READ_ONLY then
      redis.call('LTRIM', key, 0, MAX_LIMIT - 1)
    end
    n = MAX_LIMIT
  end
  s.len, s.newest, s.now_eff = n, newest, now_eff
  if newest <= horizon then
    -- Everything has left the window.
    return s
  end
  local oldest = newest
  if n > 1 then
    -- (Entry n - 1 is the last one, also when a peek left a longer list untrimmed.)
    oldest = stored(redis.call('LINDEX', key, n - 1))
  end
  local used = n
  if oldest <= horizon then
    -- Entry lo is live, entry hi has left; halve until they are neighbours.
    local lo, hi, lo_t = 0, n - 1, newest
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      local t = stored(redis.call('LINDEX', key, mid))
      if t <= horizon then
        hi = mid
      else
        lo, lo_t = mid, t
      end
    end
    used, oldest = hi, lo_t
  end
  s.used, s.oldest = used, oldest
  return s
end

local function sliding_window_peek(key, now, limit, window, cost)
  local s = memo[key]
  if not (s and s.alg == 1 and s.now == now and s.limit == limit and s.window == window) then
    memo[key] = nil
    s = sliding_window_read(key, now, limit, window)
    memo[key] = s
  end
  local used = s.used
  if used > 0 then
    set_ttl(key, s.newest + window - now)
  end
  if used + cost <= limit then
    return true, limit - used - cost, (s.oldest or s.now_eff) + window - now, s
  end
  -- Entries limit - cost .. used - 1 (from the head) must leave first; the
  -- newest of them leaves last.
  local freeing = stored(redis.call('LINDEX', key, limit - cost))
  return false, limit - used, freeing + window - now, s
end

-- A request pushes one entry per unit, PUSH_CHUNK per LPUSH, as text
-- formatted once (Redis would format a Lua number again for every entry).
-- This is the one cost that grows: with the request's own cost, about
-- 0.15 us per unit.
local function sliding_window_commit(key, now, _, window, cost, s)
  local t = s.now_eff
  -- The state's time moves to t: what has left the window by then goes.
  if s.len > s.used then
    if s.used == 0 then
      redis.call('DEL', key)
    else
      redis.call('LTRIM', key, 0, s.used - 1)
    end
  end
  local entry = string.format('%d', t)
  if cost == 1 then
    redis.call('LPUSH', key, entry)
  else
    local args = {}
    for i = 1, math.min(cost, PUSH_CHUNK) do
      args[i] = entry
    end
    local left = cost
    while left > 0 do
      local n = math.min(left, PUSH_CHUNK)
      redis.call('LPUSH', key, unpack(args, 1, n))
      left = left - n
    end
  end
  s.used = s.used + cost
  s.len = s.used
  s.newest = t
  s.oldest = s.oldest or t
  set_ttl(key, t + window - now)
end

-- Give-back: the OLDEST live entries are removed (with the expired tail,
-- in one LTRIM). The caller only asks while its own entry is certainly
-- still in the window, so no entry removed is newer than the request's
-- own: what is left counts at least as long as the truth would.
local function sliding_window_give_back(key, now, p1, p2, cost)
  local s = sliding_window_read(key, now, p1, p2)
  local back = math.min(s.used, cost)
  if back <= 0 then
    return 0
  end
  if s.used == back then
    redis.call('DEL', key)
  else
    redis.call('LTRIM', key, 0, s.used - back - 1)
  end
  return back
end

register(1, {
  kind = 'list',
  valid = window_valid(MAX_LIMIT),
  peek = sliding_window_peek,
  commit = sliding_window_commit,
  give_back = sliding_window_give_back,
  quota = window_quota,
  override = window_override(MAX_LIMIT),
})
