-- Token bucket.
-- KEY   a hash {tokens, ts, rate, burst}: tokens left at time ts (ms), and
--       the parameters it refills under. A missing key is a full bucket;
--       the key expires when the bucket would be full again.
-- p1    rate: tokens added per second
-- p2    burst: capacity
-- cost  tokens one request takes
--
-- Until the key's next decision the bucket refills under the stored
-- parameters (which is also when its TTL runs out); the next decision
-- applies the parameters in force from then on (a reload, an operator's
-- override set, changed, cleared or ended), and what was used still counts:
-- the tokens missing from the old burst are missing from the new one, so a
-- lowered burst may leave fewer than none (tokens below 0, refilled at the
-- new rate) and a raised one has more room; a bucket full under the old
-- parameters is full under the new. The key is stamped with the new
-- parameters and TTL.
-- peek returns allowed, remaining (whole tokens), ms, state:
--   allowed: ms until the bucket is full again
--   denied:  ms until cost tokens are there
define(3, 'hash', 'tokens', function()
  local TOKEN_BUCKET_FIELDS = { 'tokens', 'ts', 'rate', 'burst' }

  -- The rate and burst a bucket read as `h` refills under: the stored
  -- ones, or (a state from before they were stored) the rule's.
  local function refilled_under(h, rate, burst)
    local was_rate, was_burst = rate, burst
    if h[3] then
      was_rate = stored(h[3])
    end
    if h[4] then
      was_burst = stored(h[4])
    end
    return was_rate, was_burst
  end

  local function token_bucket_peek(key, now, rate, burst, cost)
    forget(key)
    local h = hash_read(key, 3, TOKEN_BUCKET_FIELDS)
    local tokens, now_eff = burst, now
    if h[1] or h[2] then
      local left, ts = stored(h[1]), stored(h[2])
      local was_rate, was_burst = refilled_under(h, rate, burst)
      now_eff = math.max(now, ts)
      local t = left + (now_eff - ts) * was_rate / 1000
      if t < was_burst then
        tokens = t
        if was_rate ~= rate or was_burst ~= burst then
          tokens = burst - (was_burst - t)
          if not READ_ONLY then
            redis.call('HSET', key, 'tokens', tokens, 'ts', now_eff, 'rate', rate, 'burst', burst)
            set_ttl(key, now_eff + (burst - tokens) * 1000 / rate - now)
          end
        end
      end
    end
    local s = { tokens = tokens, now_eff = now_eff }
    if tokens + 1e-9 >= cost then
      local left = math.max(0, tokens - cost)
      return true, math.floor(left + 1e-9), now_eff + (burst - left) * 1000 / rate - now, s
    end
    return false, math.max(0, math.floor(tokens + 1e-9)), now_eff + (cost - tokens) * 1000 / rate - now, s
  end

  local function token_bucket_commit(key, now, rate, burst, cost, s)
    local left = math.max(0, s.tokens - cost)
    redis.call('HSET', key, 'tokens', left, 'ts', s.now_eff, 'rate', rate, 'burst', burst)
    set_ttl(key, s.now_eff + (burst - left) * 1000 / rate - now)
  end

  -- Give-back: the tokens come back, never above burst.
  local function token_bucket_give_back(key, now, rate, burst, cost)
    local h = redis.call('HMGET', key, 'tokens', 'ts', 'rate', 'burst')
    if not (h[1] and h[2]) then
      return 0
    end
    local was_rate, was_burst = refilled_under(h, rate, burst)
    local ts = stored(h[2])
    local now_eff = math.max(now, ts)
    local tokens = stored(h[1]) + (now_eff - ts) * was_rate / 1000
    if tokens >= was_burst then
      return 0
    end
    if was_rate ~= rate or was_burst ~= burst then
      tokens = burst - (was_burst - tokens)
    end
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

  return {
    valid = function(rate, burst, cost)
      return rate and rate > 0 and rate < math.huge and whole(burst, 1, math.huge) and whole(cost, 1, burst)
    end,
    peek = token_bucket_peek,
    commit = token_bucket_commit,
    refills = true,
    give_back = token_bucket_give_back,
    quota = function(rate, burst)
      return burst, burst * 1000 / rate
    end,
    -- The override's limit is the burst; the rate scales with it, or
    -- refills the burst in the override's window.
    override = function(rate, burst, ol, ow)
      if ow and ow > 0 then
        return ol * 1000 / ow, ol
      end
      return rate * ol / burst, ol
    end,
  }
end)
