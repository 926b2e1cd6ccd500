-- Token bucket.
-- KEY   a hash {tokens, ts}: tokens left at time ts (ms, Redis clock).
--       A missing key is a full bucket; the key expires when the bucket
--       would be full again.
-- p1    rate: tokens added per second
-- p2    burst: capacity
-- cost  tokens one request takes
-- peek returns allowed, remaining (whole tokens), ms, state (tokens left):
--   allowed: ms until the bucket is full again
--   denied:  ms until cost tokens are there
local function token_bucket_peek(key, now, rate, burst, cost)
  local tokens = burst
  local saved = redis.call('HMGET', key, 'tokens', 'ts')
  if saved[1] and saved[2] then
    local elapsed = math.max(0, now - tonumber(saved[2]))
    tokens = math.min(burst, tonumber(saved[1]) + elapsed * rate / 1000)
  end
  if tokens + 1e-9 >= cost then
    local left = math.max(0, tokens - cost)
    return true, math.floor(left + 1e-9), math.ceil((burst - left) * 1000 / rate), left
  end
  return false, math.floor(tokens + 1e-9), math.ceil((cost - tokens) * 1000 / rate), tokens
end

local function token_bucket_commit(key, now, rate, burst, _, left)
  redis.call('HSET', key, 'tokens', left, 'ts', now)
  redis.call('PEXPIRE', key, math.max(1, math.ceil((burst - left) * 1000 / rate)))
end
