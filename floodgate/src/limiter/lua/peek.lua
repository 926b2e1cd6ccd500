-- Answers, for each check on its own, exactly what a decision would answer
-- now, and writes nothing: no entry, no count, no parameters, no TTL.
-- Loaded after common.lua and the algorithm files, whose peek functions it
-- calls in read-only mode (READ_ONLY, see common.lua): where a decision
-- would first rewrite a key (new parameters after a reload, another
-- algorithm's state, an old-layout counter), the answer is computed from
-- what the key would then hold, and the key is left as it is.
--
-- KEYS  one key per check
-- ARGV  [1] now override in ms ("" = Redis TIME), then per check:
--         algorithm (its code in ALGORITHMS, see common.lua),
--         p1, p2 (see each algorithm), cost
-- Returns a flat array, three values per check:
--   decided:  allowed (1/0), remaining, ms (as the batch script answers)
--   failed:   -1, error code (see common.lua), 0
READ_ONLY = {}

local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function peek_one(key, a)
  local alg, p1, p2, cost = params(a)
  return read_only_peek(alg, key, now, p1, p2, cost)
end

local out = {}
for i = 1, #KEYS do
  local at = 3 * i - 2
  local ok, allowed, remaining, ms = pcall(peek_one, KEYS[i], 2 + 4 * (i - 1))
  if ok then
    out[at] = allowed and 1 or 0
    out[at + 1] = math.max(0, math.floor(remaining))
    out[at + 2] = math.max(0, math.ceil(ms))
  else
    local code = type(allowed) == 'table' and allowed.floodgate or ERR_OTHER
    if code == ERR_OTHER then
      redis.log(redis.LOG_WARNING, 'floodgate: the peek on ' .. tostring(KEYS[i])
        .. ' failed: ' .. tostring(type(allowed) == 'table' and allowed.err or allowed))
    end
    out[at], out[at + 1], out[at + 2] = -1, code, 0
  end
end
return out
