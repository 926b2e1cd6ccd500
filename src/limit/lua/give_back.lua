-- Gives back the units of one request that was charged and then answered
-- well (a rule with count = "failures"). A separate script from the batch:
-- the batch decides, this only undoes one recorded admission.
--
-- KEYS[1] the rule's key
-- ARGV    algorithm (1 sliding_window, 2 fixed_window, 3 token_bucket),
--         p1, p2 (as the algorithm's own file names them), cost
-- Returns the units given back.
--
-- Only ever in the safe direction:
-- * sliding window: the OLDEST live entries are removed. The caller only
--   asks while its own entry is certainly still in the window, so the entry
--   removed is never newer than the request's own: what is left counts at
--   least as long as the truth would (never more admitted than the limit).
-- * fixed window: the counter goes down, never below 0. The caller only
--   asks while the window it was charged in is still open.
-- * token bucket: the tokens come back, never above burst.
-- A key of another type (a reload changed the algorithm) is left alone.
local key = KEYS[1]
local alg = tonumber(ARGV[1])
local p1, p2 = tonumber(ARGV[2]), tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local kind = redis.call('TYPE', key).ok
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if alg == 1 then
  if kind ~= 'list' then return 0 end
  local horizon = now - p2
  local oldest = redis.call('LINDEX', key, -1)
  while oldest and tonumber(oldest) <= horizon do
    redis.call('RPOP', key)
    oldest = redis.call('LINDEX', key, -1)
  end
  local given = 0
  while given < cost and redis.call('RPOP', key) do
    given = given + 1
  end
  return given
elseif alg == 2 then
  if kind ~= 'string' then return 0 end
  local used = tonumber(redis.call('GET', key)) or 0
  local back = math.min(used, cost)
  if back > 0 then
    redis.call('DECRBY', key, back)
  end
  return back
elseif alg == 3 then
  if kind ~= 'hash' then return 0 end
  local saved = redis.call('HMGET', key, 'tokens', 'ts')
  if not (saved[1] and saved[2]) then return 0 end
  local rate, burst = p1, p2
  local elapsed = math.max(0, now - tonumber(saved[2]))
  local tokens = math.min(burst, tonumber(saved[1]) + elapsed * rate / 1000)
  local left = math.min(burst, tokens + cost)
  if left >= burst then
    -- A missing key is a full bucket.
    redis.call('DEL', key)
  else
    redis.call('HSET', key, 'tokens', left, 'ts', now)
    redis.call('PEXPIRE', key, math.max(1, math.ceil((burst - left) * 1000 / rate)))
  end
  return math.floor(left - tokens + 0.5)
end
return 0
