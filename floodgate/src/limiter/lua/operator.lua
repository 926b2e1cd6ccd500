-- An operator's action on one identity under one rule, then what the rule
-- holds for it afterwards, in one atomic call. Loaded after common.lua and
-- the algorithm files: the answer comes from the same peek functions a
-- decision runs, in read-only mode, with the identity's override applied.
--
-- KEYS  [1] the identity's state key, [2] its operator record (see
--       common.lua: '!' .. KEYS[1])
-- ARGV  [1] action: inspect | reset | ban | unban | override | clear
--       [2] algorithm, [3] p1, [4] p2, [5] cost (as a decision sends them)
--       [6] ban: its length in ms; override: the limit
--       [7] override: window in ms ("" = the rule's)
--       [8] override: how long it lasts in ms ("" = until cleared)
-- Returns: limit, window ms (token bucket: ms to refill from empty),
-- units used (token bucket: tokens missing), ms to reset, ms left on the ban (0 = none), then the override
-- in force: limit, window ms (-1 = the rule's), ms to its end (-1 = none)
-- or -1, -1, -1 without one. A check that cannot be read: -1, error code.
local key, okey = KEYS[1], KEYS[2]
local action = ARGV[1]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function touch()
  local op = ops_read(key)
  if redis.call('EXISTS', okey) == 0 then
    return
  end
  local ms = ops_lifetime(op, now)
  if ms then
    redis.call('PEXPIRE', okey, math.max(1, math.ceil(ms)))
  else
    redis.call('PERSIST', okey)
  end
end

if action == 'reset' then
  redis.call('DEL', key)
  redis.call('HDEL', okey, 'ban', 'by', 'pc', 'pce', 'lv', 'lve')
  touch()
elseif action == 'ban' then
  redis.call('HSET', okey, 'ban', now + tonumber(ARGV[6]), 'by', 'operator')
  touch()
elseif action == 'unban' then
  redis.call('HDEL', okey, 'ban', 'by')
  touch()
elseif action == 'override' then
  redis.call('HSET', okey, 'ol', tonumber(ARGV[6]))
  if tonumber(ARGV[7]) then
    redis.call('HSET', okey, 'ow', tonumber(ARGV[7]))
  else
    redis.call('HDEL', okey, 'ow')
  end
  if tonumber(ARGV[8]) then
    redis.call('HSET', okey, 'oe', now + tonumber(ARGV[8]))
  else
    redis.call('HDEL', okey, 'oe')
  end
  touch()
elseif action == 'clear' then
  redis.call('HDEL', okey, 'ol', 'ow', 'oe')
  touch()
end

READ_ONLY = {}

local function look()
  local alg, p1, p2, cost = params(2)
  local op = ops_read(key)
  p1, p2 = ops_params(op, alg, p1, p2, cost, now)
  local allowed, remaining, ms = read_only_peek(alg, key, now, p1, p2, cost)
  local limit, window = ALGORITHMS[alg].quota(p1, p2)
  -- What is left now, before a request of `cost` (an admission's answer
  -- counts that request in, and where units come back one by one, the time
  -- they take too).
  local left = remaining
  if allowed then
    left = remaining + cost
    if ALGORITHMS[alg].refills then
      ms = ms - cost * window / limit
    end
  end
  local ol, ow, oe = ops_override(op, now)
  local o1, o2, o3 = -1, -1, -1
  if ol then
    o1, o2 = ol, ow or -1
    if oe then
      o3 = oe - now
    end
  end
  -- (Units used may exceed a limit lowered since.)
  local used = math.max(0, math.ceil(limit - left - 1e-9))
  return {
    limit, math.ceil(window), used, math.max(0, math.ceil(ms)),
    ops_banned(op, now) or 0, o1, o2, o3,
  }
end

local ok, answer = pcall(look)
if ok then
  return answer
end
local code = type(answer) == 'table' and answer.floodgate or ERR_OTHER
return { -1, code }
