-- Sliding-window log.
-- KEY   a list of admissions, newest at the head, one entry per admitted
--       request (the requests one call admits at one moment share one):
--       "T:C:W", admitted at T ms with a weight of W units, C the
--       running total of units up to and including it. The units in the
--       window are C of the newest entry minus (C - W) of the oldest live
--       one, so a request's cost costs Redis one entry and O(log n) reads,
--       whatever its units.
-- p1    limit: units allowed in any interval of length window (<= MAX_LIMIT)
-- p2    window, ms
-- cost  units one request takes
-- An entry admitted at t counts during [t, t + window).
--
-- Entries are dropped only once they are out of the window in force, never
-- to fit a limit: a lowered limit denies until enough entries leave, and a
-- limit raised again finds them all. Admission needs used + cost <= limit,
-- so the list never holds more entries than the largest limit in force
-- (MAX_LIMIT). A list written before entries carried their weight (a plain
-- time per unit) is read once as one entry: its live units at its newest
-- time (for one window they count a little longer: fewer admissions, never
-- more).
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
--   denied:  ms until enough units leave for this request to fit (found by
--            the running totals: a binary search, as for the live entries)
define(1, 'list', nil, function()
  local PUSH_CHUNK = 1000
  -- The oldest entries read with a list's length and newest entry; how
  -- many more the first further read takes (each next one twice as many),
  -- at most READS times per decision before a binary search. On a busy key
  -- about as many entries leave between two calls as one call admits (a
  -- batch, 10 to 30), and reads from the list's tail are cheap where a
  -- LINDEX inside it walks a packed node: two reads find them.
  local FIRST, MORE, READS = 2, 8, 4

  -- Entries already parsed, by their text: a busy key's oldest entries
  -- are read again by every call until they leave, and its newest was
  -- written by the last one. Matching and converting a text costs more
  -- than the rest of an admission. Kept from call to call by the function
  -- library (a script sent by EVAL starts without it), and started afresh
  -- once it holds PARSED_MOST texts.
  local PARSED_MOST = 4096
  local parsed, parsed_n = {}, 0
  local function remember(v, t, c, w)
    if parsed_n >= PARSED_MOST then
      parsed, parsed_n = {}, 0
    end
    parsed[v], parsed_n = { t, c, w }, parsed_n + 1
  end

  -- An entry as read: { T, C, W } (see KEY above), or fail(ERR_STATE).
  -- A table of its own: callers may change it.
  local function parse(v)
    local e = parsed[v]
    if e then
      return { e[1], e[2], e[3] }
    end
    local t, c, w = string.match(v, '^(%d+):(%d+):(%d+)$')
    if not t then
      fail(ERR_STATE)
    end
    t, c, w = tonumber(t), tonumber(c), tonumber(w)
    remember(v, t, c, w)
    return { t, c, w }
  end

  local function text(e)
    local t, c, w = e[1], e[2], e[3]
    local v = string.format('%d:%d:%d', t, c, w)
    -- (Whole numbers, so that the text reads back as these very numbers.)
    if not parsed[v] and t % 1 == 0 and c % 1 == 0 and w % 1 == 0 then
      remember(v, t, c, w)
    end
    return v
  end

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
    if n > 0 then
      local texts = {}
      for i = 1, n do
        texts[i] = text(s.push[i])
      end
      for i = 1, n, PUSH_CHUNK do
        redis.call('LPUSH', key, unpack(texts, i, math.min(n, i + PUSH_CHUNK - 1)))
      end
      s.push, s.np = {}, 0
    end
  end

  -- Entry i of the list (from the head, 0 = newest) as this call sees it:
  -- the entries not pushed yet come first, then the stored ones (the
  -- entries past `keep` are after every index asked for).
  local function entry_at(key, s, i)
    if i < s.np then
      return s.push[s.np - i]
    end
    return parse(redis.call('LINDEX', key, i - s.np))
  end

  -- Entries from..to (from the head) as this call sees them, oldest first.
  local function entries(key, s, from, to)
    local out, np = {}, s.np
    if to >= np then
      local t = redis.call('LRANGE', key, math.max(from, np) - np, to - np)
      for j = #t, 1, -1 do
        out[#out + 1] = parse(t[j])
      end
    end
    for i = math.min(to, np - 1), from, -1 do
      out[#out + 1] = s.push[np - i]
    end
    return out
  end

  local function empty()
    return { alg = 1, len = 0, tail = {}, push = {}, np = 0, flush = sliding_window_flush }
  end

  -- A list of plain times, one per unit (written before entries carried
  -- their weight), of n entries: its live units at `now` (a binary search)
  -- become one entry at its newest time, written at once unless peeking.
  local function sliding_window_legacy(key, n, now, window)
    local newest = stored(redis.call('LINDEX', key, 0))
    local horizon = max(now, newest) - window
    local live = 0
    if newest > horizon then
      local lo, hi = 0, n
      while hi - lo > 1 do
        local mid = math.floor((lo + hi) / 2)
        if stored(redis.call('LINDEX', key, mid)) <= horizon then
          hi = mid
        else
          lo = mid
        end
      end
      live = hi
    end
    if not READ_ONLY then
      redis.call('DEL', key)
    end
    if live == 0 then
      return empty()
    end
    local e = { newest, live, live }
    if not READ_ONLY then
      redis.call('RPUSH', key, text(e))
      redis.call('PEXPIRE', key, max(1, ceil(newest + window - now)))
    end
    return { alg = 1, len = 1, newest = e, tail = { e }, push = {}, np = 0,
      flush = sliding_window_flush }
  end

  -- What is known of the list at key: its length `len`, its newest entry,
  -- and `tail`, its oldest entries, oldest first (tail[i] is at index
  -- len - i). Nothing is known of an empty list's entries.
  local function sliding_window_load(key, now, window)
    local n = (READ_ONLY and READ_ONLY[key]) and 0 or redis.call('LLEN', key)
    if n == 0 then
      return empty()
    end
    if n > MAX_LIMIT then
      -- Only a list this code did not write: no limit can look past MAX_LIMIT entries.
      if not READ_ONLY then
        redis.call('LTRIM', key, 0, MAX_LIMIT - 1)
      end
      n = MAX_LIMIT
    end
    local head = redis.call('LINDEX', key, 0)
    if tonumber(head) then
      return sliding_window_legacy(key, n, now, window)
    end
    local tail, newest = {}, nil
    if n <= FIRST + 1 then
      local all = redis.call('LRANGE', key, 0, n - 1)
      for i = 1, n do
        tail[i] = parse(all[n + 1 - i])
      end
      newest = tail[n]
    else
      newest = parse(head)
      local t = redis.call('LRANGE', key, n - FIRST, n - 1)
      for i = 1, FIRST do
        tail[i] = parse(t[FIRST + 1 - i])
      end
    end
    return { alg = 1, len = n, newest = newest, tail = tail, push = {}, np = 0,
      flush = sliding_window_flush }
  end

  -- The list at `now`, from what is known of it (loaded when nothing is
  -- yet; more read when every known entry has left, see Work above): sets
  -- its `now_eff`, `live` (the entries from the head still in the window),
  -- `oldest` (the oldest of them) and `used` (their units).
  local function sliding_window_read(key, now, window)
    local s = memo[key]
    if not (s and s.alg == 1) then
      s = sliding_window_load(key, now, window)
      memo[key] = s
    end
    s.used, s.live, s.oldest, s.now_eff = 0, 0, nil, now
    if s.len == 0 then
      return s
    end
    local newest = s.newest
    local now_eff = max(now, newest[1])
    local horizon = now_eff - window
    s.now_eff = now_eff
    if newest[1] <= horizon then
      -- Everything has left the window.
      return s
    end
    local tail = s.tail
    local gone, reads, more = 0, 0, MORE
    while true do
      local k = #tail
      while gone < k and tail[gone + 1][1] <= horizon do
        gone = gone + 1
      end
      if gone < k then
        local oldest = tail[gone + 1]
        s.live, s.oldest = s.len - gone, oldest
        s.used = newest[2] - (oldest[2] - oldest[3])
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
    local lo, hi, lo_e = 0, s.len - #tail, newest
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      local e = entry_at(key, s, mid)
      if e[1] <= horizon then
        hi = mid
      else
        lo, lo_e = mid, e
      end
    end
    s.live, s.oldest = hi, lo_e
    s.used = newest[2] - (lo_e[2] - lo_e[3])
    return s
  end

  -- The oldest live entry whose running total reaches `total` (at most the
  -- newest's), and its index from the head: the known oldest entries
  -- first, then a binary search.
  local function reaching(key, s, total)
    local tail, len = s.tail, s.len
    local k = #tail
    for j = s.len - s.live + 1, k do
      if tail[j][2] >= total then
        return tail[j], len - j
      end
    end
    -- Entry lo reaches it, entry hi does not.
    local lo, hi, lo_e = 0, len - k, s.newest
    if k == 0 then
      hi = len
    end
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      local e = entry_at(key, s, mid)
      if e[2] >= total then
        lo, lo_e = mid, e
      else
        hi = mid
      end
    end
    return lo_e, lo
  end

  local function sliding_window_peek(key, now, limit, window, cost)
    local s = sliding_window_read(key, now, window)
    local used = s.used
    if used > 0 then
      set_ttl(key, s.newest[1] + window - now)
    end
    if used + cost <= limit then
      return true, limit - used - cost, (s.oldest and s.oldest[1] or s.now_eff) + window - now, s
    end
    -- The oldest live units must leave until this request fits: the entry
    -- holding the last of them leaves last.
    local base = s.oldest[2] - s.oldest[3]
    local freeing = reaching(key, s, base + used + cost - limit)
    return false, limit - used, freeing[1] + window - now, s
  end

  -- An admission's writes wait in the key's memo entry until the call ends
  -- (or until another algorithm reads the key, see forget): on a key
  -- decided many times in one call, one LTRIM and one LPUSH in all.
  local function sliding_window_commit(key, now, _, window, cost, s)
    local t = s.now_eff
    -- The state's time moves to t: what has left the window by then goes,
    -- and with it from what is known of the oldest entries.
    local gone = s.len - s.live
    if gone > 0 then
      local stored_left = s.live - s.np
      if stored_left >= 0 then
        s.keep = stored_left
      else
        -- Entries this call pushed have left too (the oldest of them).
        local left = {}
        for i = 1, s.live do
          left[i] = s.push[s.np - s.live + i]
        end
        s.keep, s.push, s.np = 0, left, s.live
      end
      local tail, k = s.tail, #s.tail
      for i = 1, k do
        tail[i] = tail[i + gone]
      end
    end
    local last = s.push[s.np]
    if last and last[1] == t then
      -- Admitted at the same moment as the last request of this call: one
      -- entry carries both (their units leave together).
      last[2], last[3] = last[2] + cost, last[3] + cost
    else
      local e = { t, (s.live > 0 and s.newest[2] or 0) + cost, cost }
      s.np = s.np + 1
      s.push[s.np] = e
      s.live = s.live + 1
    end
    s.len = s.live
    local e = s.push[s.np]
    s.used = s.used + cost
    s.newest = e
    s.oldest = s.oldest or e
    set_ttl(key, t + window - now)
  end

  -- Give-back: the OLDEST live units are removed: the entries they fill
  -- whole (with the expired tail, in one LTRIM), and from the entry
  -- holding the last of them, that part of its weight (LSET). The caller
  -- only asks while its own entry is certainly still in the window, so no
  -- unit removed is newer than the request's own: what is left counts at
  -- least as long as the truth would.
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
      return back
    end
    local gone = s.oldest[2] - s.oldest[3] + back
    local e, i = reaching(key, s, gone + 1)
    redis.call('LTRIM', key, 0, i)
    local w = e[2] - gone
    if w < e[3] then
      redis.call('LSET', key, i, text({ e[1], e[2], w }))
    end
    return back
  end

  -- The same request again, right after commit() (see common.lua): the
  -- clock has not moved, so neither has what is live (commit() left the
  -- oldest live entry and the units they hold in `s`).
  local function sliding_window_again(_, now, limit, window, cost, s)
    local used = s.used
    if used + cost > limit then
      return false
    end
    return true, limit - used - cost, s.oldest[1] + window - now
  end

  -- commit() after again(): the admission joins the entry of the one
  -- before it (same moment), as commit() would join them.
  local function sliding_window_commit_again(_, _, _, _, cost, s)
    local last = s.push[s.np]
    last[2], last[3] = last[2] + cost, last[3] + cost
    s.used = s.used + cost
  end

  return {
    valid = window_valid(MAX_LIMIT),
    peek = sliding_window_peek,
    commit = sliding_window_commit,
    again = sliding_window_again,
    commit_again = sliding_window_commit_again,
    give_back = sliding_window_give_back,
    quota = window_quota,
    override = window_override(MAX_LIMIT),
  }
end)
