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
-- Work: a decision reads the list's length, its newest entry and its
-- FIRST oldest ones (LLEN, LINDEX 0, LRANGE); a request that finds all of
-- those gone reads MORE entries before them (LRANGE), then twice as many
-- each time, and only when still more have left (an idle key, a shortened
-- window) does it search the list (binary search with LINDEX: it is
-- sorted), so a decision costs O(log n) list reads at most whatever the
-- limit and however many entries leave at once, and three in the common
-- case. Within one call, what was read is
-- kept in `memo`, and an admission's writes (one LTRIM for what left the
-- window, one LPUSH of its entries) wait there until the call ends: the
-- next decision on the same key, at the same clock or a later one, reads
-- and writes nothing while a known entry is still live. Only a request's
-- own units cost one entry each.
--
-- The key lives until its newest entry leaves the window in force at the
-- last decision: every decision on a live key sets its TTL again, so a
-- window made longer by a reload keeps the log long enough.
--
-- peek returns allowed, remaining, ms, state:
--   allowed: ms until the oldest entry leaves (the reset of RateLimit)
--   denied:  ms until enough entries leave for this request to fit
define(1, 'list', nil, function()
  local PUSH_CHUNK = 1000
  -- The last entry formatted, and its time: a call's decisions are mostly
  -- at one time.
  local last_t, last_entry
  -- The oldest entries read with a list's length and newest entry; how
  -- many more the first further read takes (each next one twice as many),
  -- at most READS times per decision before a binary search. On a busy key
  -- about as many entries leave between two calls as one call admits (a
  -- batch, 10 to 30), and reads from the list's tail are cheap where a
  -- LINDEX inside it walks a packed node: two reads find them.
  local FIRST, MORE, READS = 2, 8, 4

  -- Writes a call's decisions have not made yet (see commit): the stored
  -- list keeps its `keep` newest entries (nil: all of them), then the
  -- entries in `push` (oldest first) go on its head.
  local function sliding_window_flush(key, s)
    if s.keep then
      if s.keep == 0 then
        redis.call('DEL', key)
      else
        redis.call('LTRIM', key, 0, s.keep - 1)
      end
      s.keep = nil
    end
    local n = s.np
    for i = 1, n, PUSH_CHUNK do
      redis.call('LPUSH', key, unpack(s.push, i, math.min(n, i + PUSH_CHUNK - 1)))
    end
    if n > 0 then
      s.push, s.np = {}, 0
    end
  end

  -- Entry i of the list (from the head, 0 = newest) as this call sees it:
  -- the entries not pushed yet come first, then the stored ones (the
  -- entries past `keep` are after every index asked for).
  local function entry_at(key, s, i)
    if i < s.np then
      return stored(s.push[s.np - i])
    end
    return stored(redis.call('LINDEX', key, i - s.np))
  end

  -- Entries from..to (from the head) as this call sees them, oldest first.
  local function entries(key, s, from, to)
    local out, np = {}, s.np
    if to >= np then
      local t = redis.call('LRANGE', key, math.max(from, np) - np, to - np)
      for j = #t, 1, -1 do
        out[#out + 1] = stored(t[j])
      end
    end
    for i = math.min(to, np - 1), from, -1 do
      out[#out + 1] = stored(s.push[np - i])
    end
    return out
  end

  -- What is known of the list at key: its length `len`, its newest entry,
  -- and `tail`, its oldest entries, oldest first (tail[i] is at index
  -- len - i). Nothing is known of an empty list's entries.
  local function sliding_window_load(key)
    local n = (READ_ONLY and READ_ONLY[key]) and 0 or redis.call('LLEN', key)
    if n == 0 then
      return { alg = 1, len = 0, tail = {}, push = {}, np = 0, flush = sliding_window_flush }
    end
    if n > MAX_LIMIT then
      -- Only a list this code did not write: no limit can look past MAX_LIMIT entries.
      if not READ_ONLY then
        redis.call('LTRIM', key, 0, MAX_LIMIT - 1)
      end
      n = MAX_LIMIT
    end
    local tail, newest = {}, nil
    if n <= FIRST + 1 then
      local all = redis.call('LRANGE', key, 0, n - 1)
      for i = 1, n do
        tail[i] = stored(all[n + 1 - i])
      end
      newest = tail[n]
    else
      newest = stored(redis.call('LINDEX', key, 0))
      local t = redis.call('LRANGE', key, n - FIRST, n - 1)
      for i = 1, FIRST do
        tail[i] = stored(t[FIRST + 1 - i])
      end
    end
    return { alg = 1, len = n, newest = newest, tail = tail, push = {}, np = 0,
      flush = sliding_window_flush }
  end

  -- The list at `now`, from what is known of it (loaded when nothing is
  -- yet; more read when every known entry has left, see Work above): sets
  -- its `now_eff`, `used` (the entries from the head still in the window)
  -- and `oldest` (the oldest of them).
  local function sliding_window_read(key, now, window)
    local s = memo[key]
    if not (s and s.alg == 1) then
      s = sliding_window_load(key)
      memo[key] = s
    end
    s.used, s.oldest, s.now_eff = 0, nil, now
    if s.len == 0 then
      return s
    end
    local newest = s.newest
    local now_eff = max(now, newest)
    local horizon = now_eff - window
    s.now_eff = now_eff
    if newest <= horizon then
      -- Everything has left the window.
      return s
    end
    local tail = s.tail
    local gone, reads, more = 0, 0, MORE
    while true do
      local k = #tail
      while gone < k and tail[gone + 1] <= horizon do
        gone = gone + 1
      end
      if gone < k then
        s.used, s.oldest = s.len - gone, tail[gone + 1]
        return s
      end
      -- Every known entry has left: read the MORE entries before them.
      local before = s.len - k
      if reads == READS or before <= 1 then
        break
      end
      reads = reads + 1
      local t = entries(key, s, math.max(0, before - more), before - 1)
      more = 2 * more
      for j = 1, #t do
        tail[k + j] = t[j]
      end
    end
    -- Entry lo is live, entry hi has left; halve until they are neighbours.
    local lo, hi, lo_t = 0, s.len - #tail, newest
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      local t = entry_at(key, s, mid)
      if t <= horizon then
        hi = mid
      else
        lo, lo_t = mid, t
      end
    end
    s.used, s.oldest = hi, lo_t
    return s
  end

  local function sliding_window_peek(key, now, limit, window, cost)
    local s = sliding_window_read(key, now, window)
    local used = s.used
    if used > 0 then
      set_ttl(key, s.newest + window - now)
    end
    if used + cost <= limit then
      return true, limit - used - cost, (s.oldest or s.now_eff) + window - now, s
    end
    -- Entries limit - cost .. used - 1 (from the head) must leave first; the
    -- newest of them leaves last.
    local at = limit - cost
    local freeing = s.tail[s.len - at]
    if not freeing then
      freeing = entry_at(key, s, at)
    end
    return false, limit - used, freeing + window - now, s
  end

  -- An admission's writes wait in the key's memo entry until the call ends
  -- (or until another algorithm reads the key, see forget): on a key
  -- decided many times in one call, one LTRIM and one LPUSH in all. The entries are
  -- text formatted once (Redis would format a Lua number again for each),
  -- PUSH_CHUNK per LPUSH: a request's own units are the one cost that
  -- grows, about 0.15 us per unit.
  local function sliding_window_commit(key, now, _, window, cost, s)
    local t = s.now_eff
    -- The state's time moves to t: what has left the window by then goes,
    -- and with it from what is known of the oldest entries.
    local gone = s.len - s.used
    if gone > 0 then
      local stored_left = s.used - s.np
      if stored_left >= 0 then
        s.keep = stored_left
      else
        -- Entries this call pushed have left too (the oldest of them).
        local left = {}
        for i = 1, s.used do
          left[i] = s.push[s.np - s.used + i]
        end
        s.keep, s.push, s.np = 0, left, s.used
      end
      local tail, k = s.tail, #s.tail
      for i = 1, k do
        tail[i] = tail[i + gone]
      end
    end
    if t ~= last_t then
      last_t, last_entry = t, string.format('%d', t)
    end
    local entry = last_entry
    local push, np = s.push, s.np
    for i = np + 1, np + cost do
      push[i] = entry
    end
    s.np = np + cost
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
    forget(key)
    local s = sliding_window_read(key, now, p2)
    memo[key] = nil
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

  return {
    valid = window_valid(MAX_LIMIT),
    peek = sliding_window_peek,
    commit = sliding_window_commit,
    give_back = sliding_window_give_back,
    quota = window_quota,
    override = window_override(MAX_LIMIT),
  }
end)
