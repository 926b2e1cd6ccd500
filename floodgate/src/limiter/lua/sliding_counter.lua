-- Sliding-window counter (approximate, two counters per key).
-- KEY   a hash {cws, cur, prev, cw}: the fixed window that opened at `cws`
--       (ms) has `cur` units, the one before it `prev`, under a window of
--       `cw` ms. Windows are aligned to the epoch of the deciding clock
--       (a window opens at every multiple of W).
-- p1    limit L (1..MAX_LARGE_LIMIT)
-- p2    window W, ms
-- cost  units c one request takes (1..L)
--
-- At a moment e ms into the current window the estimate is
-- prev * (W - e) / W + cur, and a request is admitted when
-- estimate + c <= L, computed as prev * (W - e) <= (L - c - cur) * W with
-- cur + c <= L (exact while the products stay below 2^53). So one fixed
-- window never holds more than L; a sliding interval may hold up to 2 L
-- in adversarial timing. A denial's wait is the first moment the same
-- request fits with no other traffic; an admission's reset (and the TTL)
-- is the end of the next window, when both counts have left.
--
-- Time: the state's own time is its window's start: a decision's clock is
-- max(now, cws). A changed limit applies to the counts at once. A changed
-- window (a reload, an operator's override set, changed, cleared or ended)
-- keeps what was used: the old windows' estimate at that moment, rounded
-- up, becomes the count of the new current window (and, one window later,
-- its previous one), so no change of window gives the units back.
define(5, 'hash', 'cws', function()
  local SLIDING_COUNTER_FIELDS = { 'cws', 'cur', 'prev', 'cw' }

  -- The current window's start, cur and prev at now_eff, and now_eff.
  local function sliding_counter_read(key, now, window)
    local h = hash_read(key, 5, SLIDING_COUNTER_FIELDS)
    local now_eff = now
    local cws, cur, prev = nil, 0, 0
    if h[1] then
      local start, c, p, w = stored(h[1]), stored(h[2]), stored(h[3]), stored(h[4])
      now_eff = math.max(now, start)
      if w == window then
        cws, cur, prev = start, c, p
      elseif w > 0 then
        -- The estimate under the old window at now_eff, carried over.
        local ows = now_eff - now_eff % w
        local oc, op = 0, 0
        if ows == start then
          oc, op = c, p
        elseif ows == start + w then
          op = c
        end
        local used = op * (w - (now_eff - ows)) / w + oc
        cws, cur, prev = now_eff - now_eff % window, math.ceil(used - 1e-9), 0
      end
    end
    local ws = now_eff - now_eff % window
    if cws ~= ws then
      if cws and ws == cws + window then
        prev, cur = cur, 0
      else
        prev, cur = 0, 0
      end
    end
    return ws, cur, prev, now_eff
  end

  -- The first moment from window start ws at which c fits over cur and prev.
  local function sliding_counter_fits_at(ws, cur, prev, limit, window, cost)
    if cur + cost > limit then
      -- Not in this window: in the next, where cur is the previous one.
      ws, prev, cur = ws + window, cur, 0
    end
    if prev == 0 then
      return ws
    end
    return ws + window - math.floor((limit - cost - cur) * window / prev)
  end

  local function sliding_counter_peek(key, now, limit, window, cost)
    forget(key)
    local ws, cur, prev, now_eff = sliding_counter_read(key, now, window)
    local e = now_eff - ws
    local weighted = prev * (window - e)
    local s = { ws = ws, cur = cur, prev = prev }
    if cur + cost <= limit and weighted <= (limit - cost - cur) * window then
      local remaining = math.floor(((limit - cur - cost) * window - weighted) / window)
      return true, math.max(0, remaining), ws + 2 * window - now, s
    end
    local remaining = math.floor(((limit - cur) * window - weighted) / window)
    local at = sliding_counter_fits_at(ws, cur, prev, limit, window, cost)
    return false, math.max(0, remaining), math.max(at, now_eff) - now, s
  end

  local function sliding_counter_commit(key, now, _, window, cost, s)
    redis.call('HSET', key, 'cws', s.ws, 'cur', s.cur + cost, 'prev', s.prev, 'cw', window)
    set_ttl(key, s.ws + 2 * window - now)
  end

  -- Give-back: `cur` goes down, never below 0, and only while the window the
  -- request was counted in is still the current one (the caller asks only
  -- then, see Algorithm::give_back_safe).
  local function sliding_counter_give_back(key, now, _, window, cost)
    local h = redis.call('HMGET', key, 'cws', 'cur', 'cw')
    if not (h[1] and h[2] and h[3]) then
      return 0
    end
    local start, cur, w = stored(h[1]), stored(h[2]), stored(h[3])
    local now_eff = math.max(now, start)
    if w ~= window or now_eff - now_eff % window ~= start then
      return 0
    end
    return hash_give_back(key, 'cur', cur, cost)
  end

  return {
    valid = window_valid(MAX_LARGE_LIMIT),
    peek = sliding_counter_peek,
    commit = sliding_counter_commit,
    give_back = sliding_counter_give_back,
    quota = window_quota,
    override = window_override(MAX_LARGE_LIMIT),
  }
end)
