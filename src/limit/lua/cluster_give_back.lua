-- Redis Cluster: gives back what an allowed slot group of a request took
-- when another group of the same request denied it (or failed), so that a
-- denied request keeps no quota. All keys are in one slot.
--
-- KEYS  the keys to give back
-- ARGV  per key, 7 values: algorithm (1 sliding_window, 2 fixed_window,
--       3 token_bucket), p1, p2, cost, the clock of the call that took the
--       units (ms), the ms that call reported (fixed window: until the
--       window closed), and a pinned clock ("" = Redis TIME).
-- Returns the number of keys seen.
local clock
for i, key in ipairs(KEYS) do
  local a = (i - 1) * 7
  local alg = tonumber(ARGV[a + 1])
  local p1, p2 = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local cost = tonumber(ARGV[a + 4])
  local taken_at, reported = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local now = tonumber(ARGV[a + 7])
  if not now then
    if not clock then
      local t = redis.call('TIME')
      clock = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    now = clock
  end
  local kind = redis.call('TYPE', key)['ok']
  if alg == 1 and kind == 'list' then
    -- The entries pushed at taken_at; any entries of that same ms are alike.
    redis.call('LREM', key, cost, taken_at)
  elseif alg == 2 and kind == 'string' then
    -- Only into the window that took them: a later window closes at least
    -- one window length after it.
    local ttl = redis.call('PTTL', key)
    local used = tonumber(redis.call('GET', key)) or 0
    if ttl > 0 and now + ttl < taken_at + reported + p2 and used >= cost then
      redis.call('DECRBY', key, cost)
    end
  elseif alg == 3 and kind == 'hash' then
    -- p1 rate, p2 burst: the tokens come back, never above the burst.
    local saved = redis.call('HMGET', key, 'tokens', 'ts')
    if saved[1] and saved[2] then
      local elapsed = math.max(0, now - tonumber(saved[2]))
      local tokens = math.min(p2, tonumber(saved[1]) + elapsed * p1 / 1000)
      tokens = math.min(p2, tokens + cost)
      redis.call('HSET', key, 'tokens', tokens, 'ts', now)
      redis.call('PEXPIRE', key, math.max(1, math.ceil((p2 - tokens) * 1000 / p1)))
    end
  end
end
return #KEYS
