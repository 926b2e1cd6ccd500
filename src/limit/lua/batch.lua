-- Decides a batch of requests, in order, in one atomic call.
-- Each request ("job") has one check per matching rule. A job is allowed
-- only if every enforce check allows it, and only then are its checks
-- recorded (a denied request takes no quota from any rule).
--
-- KEYS  one key per check, jobs one after another
-- ARGV  [1] number of jobs, then per job:
--         now override in ms ("" = Redis TIME; tests pin the clock with it),
--         number of checks, then per check:
--           algorithm (1 sliding_window, 2 fixed_window, 3 token_bucket),
--           p1, p2 (see each algorithm), cost, enforce (1) or shadow (0)
-- Returns a flat array, per check: allowed (1/0), remaining, ms
-- (ms: retry-after when denied, time to reset when allowed).
-- A key of the wrong type (a reload changed a rule's algorithm) is reset.
local peeks = { sliding_window_peek, fixed_window_peek, token_bucket_peek }
local commits = { sliding_window_commit, fixed_window_commit, token_bucket_commit }

local clock
local function redis_now()
  if not clock then
    local t = redis.call('TIME')
    clock = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return clock
end

-- A key that holds another algorithm's state (a reload changed the rule's
-- algorithm) is started afresh rather than failing the whole batch.
local function peek(alg, key, now, p1, p2, cost)
  local ok, allowed, remaining, ms, state = pcall(peeks[alg], key, now, p1, p2, cost)
  if ok then
    return allowed, remaining, ms, state
  end
  redis.call('DEL', key)
  return peeks[alg](key, now, p1, p2, cost)
end

local function emit(out, allowed, remaining, ms)
  out[#out + 1] = allowed and 1 or 0
  out[#out + 1] = math.max(0, math.floor(remaining))
  out[#out + 1] = math.max(0, math.ceil(ms))
end

-- Several rules: peek every check, commit them all only if every enforce
-- check allows. Returns the next KEYS and ARGV positions.
local function decide_job(out, n, now, k, a)
  local checks = {}
  local all_enforced_allow = true
  for i = 1, n do
    local alg = tonumber(ARGV[a])
    local p1, p2 = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local cost = tonumber(ARGV[a + 3])
    local enforce = ARGV[a + 4] == '1'
    a = a + 5
    local allowed, remaining, ms, state = peek(alg, KEYS[k], now, p1, p2, cost)
    checks[i] = { KEYS[k], alg, p1, p2, cost, allowed, remaining, ms, state }
    k = k + 1
    if enforce and not allowed then
      all_enforced_allow = false
    end
  end
  for i = 1, n do
    local c = checks[i]
    if all_enforced_allow and c[6] then
      commits[c[2]](c[1], now, c[3], c[4], c[5], c[9])
    end
    emit(out, c[6], c[7], c[8])
  end
  return k, a
end

local out = {}
local a = 2
local k = 1
for _ = 1, tonumber(ARGV[1]) do
  local now = tonumber(ARGV[a]) or redis_now()
  local n = tonumber(ARGV[a + 1])
  a = a + 2
  if n == 1 then
    -- One rule (the common case): no bookkeeping across checks.
    local alg = tonumber(ARGV[a])
    local p1, p2 = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local cost = tonumber(ARGV[a + 3])
    a = a + 5
    local allowed, remaining, ms, state = peek(alg, KEYS[k], now, p1, p2, cost)
    if allowed then
      commits[alg](KEYS[k], now, p1, p2, cost, state)
    end
    k = k + 1
    emit(out, allowed, remaining, ms)
  else
    k, a = decide_job(out, n, now, k, a)
  end
end
return out
