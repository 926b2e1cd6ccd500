-- give_back(key, alg, p1, p2, cost, now): gives back the units one request
-- took from one key; returns the units given back. Loaded after common.lua
-- and sliding_window.lua (it reads a log the way a decision does). Used by
-- give_back.lua (count = "failures") and cluster_give_back.lua (a request
-- denied by another slot group).
--
-- Only ever in the safe direction, and with the same bounded work as a
-- decision (no loop over entries):
-- * sliding window: the OLDEST live entries are removed (with the expired
--   tail, in one LTRIM). The caller only asks while its own entry is
--   certainly still in the window, so no entry removed is newer than the
--   request's own: what is left counts at least as long as the truth would.
-- * fixed window: `used` goes down, never below 0, and only while the
--   window the request was charged in is still open.
-- * token bucket: the tokens come back, never above burst.
-- A key holding another algorithm's state is left alone. Time is never
-- earlier than the state's own, as in a decision.
local function give_back(key, alg, p1, p2, cost, now)
  local kind = redis.call('TYPE', key).ok

  if alg == 1 then
    if kind ~= 'list' then return 0 end
    local s = sliding_window_read(key, now, p1, p2)
    local back = math.min(s.used, cost)
    if back <= 0 then return 0 end
    if s.used == back then
      redis.call('DEL', key)
    else
      redis.call('LTRIM', key, 0, s.used - back - 1)
    end
    return back
  end

  if kind ~= 'hash' then return 0 end
  if alg == 2 then
    local h = redis.call('HMGET', key, 'start', 'used', 'window')
    if not (h[1] and h[2]) then return 0 end
    local start, used = stored(h[1]), stored(h[2])
    local window = p2
    if h[3] then window = stored(h[3]) end
    if math.max(now, start) >= start + window then return 0 end
    local back = math.min(used, cost)
    if back > 0 then
      redis.call('HINCRBY', key, 'used', -back)
    end
    return back
  elseif alg == 3 then
    local h = redis.call('HMGET', key, 'tokens', 'ts', 'rate', 'burst')
    if not (h[1] and h[2]) then return 0 end
    local rate, burst = p1, p2
    local was_rate, was_burst = rate, burst
    if h[3] then was_rate = stored(h[3]) end
    if h[4] then was_burst = stored(h[4]) end
    local ts = stored(h[2])
    local now_eff = math.max(now, ts)
    local tokens = stored(h[1]) + (now_eff - ts) * was_rate / 1000
    if tokens >= was_burst then return 0 end
    tokens = math.min(tokens, burst)
    local left = math.min(burst, tokens + cost)
    if left >= burst then
      -- A missing key is a full bucket.
      redis.call('DEL', key)
    else
      redis.call('HSET', key, 'tokens', left, 'ts', now_eff, 'rate', rate, 'burst', burst)
      redis.call('PEXPIRE', key, math.max(1, math.ceil(now_eff + (burst - left) * 1000 / rate - now)))
    end
    return math.floor(left - tokens + 0.5)
  end
  return 0
end
