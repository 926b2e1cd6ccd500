-- Decides a batch of requests, in order, in one atomic call.
-- Each request ("job") has one check per matching rule. A job is allowed
-- only if every enforce check allows it, and only then are its checks
-- recorded (a denied request takes no quota from any rule).
--
-- KEYS  one key per check, jobs one after another
-- ARGV  [1] number of jobs, then per job:
--         now override in ms ("" = Redis TIME; tests pin the clock with it),
--         deadline in ms on Redis's clock ("" = none): a job that reaches
--         Redis at or after it is skipped, because its caller has given up,
--         number of checks, then per check:
--           algorithm (1 sliding_window, 2 fixed_window, 3 token_bucket),
--           p1, p2 (see each algorithm), cost, enforce (1) or shadow (0)
-- Returns a flat array, three values per check:
--   decided:  allowed (1/0), remaining, ms
--             (ms: retry-after when denied, time to reset when allowed)
--   failed:   -1, error code (see common.lua), index of the failing check
--             within its job (every check of a failed job says the same)
--   skipped:  -2, 0, 0 (past its deadline: nothing read, nothing recorded)
-- and, last, Redis's clock in microseconds (the dispatcher keeps its
-- estimate of Redis time from it).
-- A job that fails (a key of a type no algorithm writes, parameters out of
-- range, unreadable state) fails alone: it records nothing, and the other
-- jobs are decided as if it had not been there. A key that holds another
-- algorithm's state (a reload changed the rule's algorithm) is started
-- afresh. Every key written gets its TTL before the call returns.
local peeks = { sliding_window_peek, fixed_window_peek, token_bucket_peek }
local commits = { sliding_window_commit, fixed_window_commit, token_bucket_commit }

-- Redis's clock, read once: every job of the call is decided at this moment.
local time = redis.call('TIME')
local clock_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local clock = math.floor(clock_us / 1000)
local function redis_now()
  return clock
end

local function peek(alg, key, now, p1, p2, cost)
  local ok, allowed, remaining, ms, state = pcall(peeks[alg], key, now, p1, p2, cost)
  if ok then
    return allowed, remaining, ms, state
  end
  if not wrong_type(allowed) then
    error(allowed, 0)
  end
  local who = owner(key)
  if who == nil or who == alg then
    fail(ERR_TYPE)
  end
  memo[key] = nil
  if who == 'legacy' and alg == 2 then
    fixed_window_adopt(key, now, p2)
  else
    redis.call('DEL', key)
  end
  return peeks[alg](key, now, p1, p2, cost)
end

local out = {}
-- The check being decided, counted from 0 within its job (for errors).
local failing = 0

local function emit(k, allowed, remaining, ms)
  local at = 3 * k - 2
  out[at] = allowed and 1 or 0
  out[at + 1] = math.max(0, math.floor(remaining))
  out[at + 2] = math.max(0, math.ceil(ms))
end

-- Decides the n checks of one job: KEYS from k, ARGV from a.
local function decide_job(n, now, k, a)
  if n == 1 then
    -- One rule (the common case): no bookkeeping across checks.
    failing = 0
    local alg, p1, p2, cost = params(a)
    local key = KEYS[k]
    local allowed, remaining, ms, state = peek(alg, key, now, p1, p2, cost)
    if allowed then
      commits[alg](key, now, p1, p2, cost, state)
    end
    emit(k, allowed, remaining, ms)
    return
  end
  -- Several rules: peek every check, commit them all only if every
  -- enforce check allows.
  local checks = {}
  local all_enforced_allow = true
  for i = 1, n do
    failing = i - 1
    local alg, p1, p2, cost = params(a)
    local enforce = ARGV[a + 4] == '1'
    local key = KEYS[k + i - 1]
    local allowed, remaining, ms, state = peek(alg, key, now, p1, p2, cost)
    checks[i] = { key, alg, p1, p2, cost, allowed, remaining, ms, state }
    if enforce and not allowed then
      all_enforced_allow = false
    end
    a = a + 5
  end
  for i = 1, n do
    failing = i - 1
    local c = checks[i]
    if all_enforced_allow and c[6] then
      commits[c[2]](c[1], now, c[3], c[4], c[5], c[9])
    end
    emit(k + i - 1, c[6], c[7], c[8])
  end
end

local a = 2
local k = 1
for _ = 1, tonumber(ARGV[1]) do
  local now = tonumber(ARGV[a]) or redis_now()
  local deadline = tonumber(ARGV[a + 1])
  local n = tonumber(ARGV[a + 2])
  local ok, e = true, nil
  if deadline and clock >= deadline then
    -- Its caller has stopped waiting: decide nothing.
    for i = k, k + n - 1 do
      local at = 3 * i - 2
      out[at], out[at + 1], out[at + 2] = -2, 0, 0
    end
  else
    ok, e = pcall(decide_job, n, now, k, a + 3)
  end
  if not ok then
    local code = type(e) == 'table' and e.floodgate
    if not code then
      code = ERR_OTHER
      redis.log(redis.LOG_WARNING, 'floodgate: the check on ' .. tostring(KEYS[k + failing])
        .. ' failed: ' .. tostring(message(e)))
    end
    for i = k, k + n - 1 do
      local at = 3 * i - 2
      out[at], out[at + 1], out[at + 2] = -1, code, failing
    end
  end
  a = a + 3 + 5 * n
  k = k + n
end
for key, ms in pairs(expire_in) do
  redis.call('PEXPIRE', key, ms)
end
out[3 * (k - 1) + 1] = clock_us
return out
