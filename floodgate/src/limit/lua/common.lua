-- Shared by the algorithms and the batch driver; loaded first.
--
-- Time: every state remembers the time it was last written at on the clock
-- that decided it, and a decision never treats time as earlier than that
-- (now_eff = max(now, the state's time)), so a clock that steps back cannot
-- make room that the state does not have. Waits are answered on the
-- caller's clock (`now`), so that a retry after them is in time.
--
-- Errors: a check that cannot be decided raises fail(code); the driver fails
-- that request alone and decides the rest of the batch normally.
local ERR_TYPE = 1 -- the key holds a Redis type no algorithm here writes
local ERR_PARAMS = 2 -- the check's parameters are out of range
local ERR_STATE = 3 -- the key's state is not made of numbers
local ERR_OTHER = 4 -- anything else (the message goes to the Redis log)

-- The largest limit a window rule may have; no log grows past it.
local MAX_LIMIT = 100000

local function fail(code)
  error({ floodgate = code }, 0)
end

-- A number read back from Redis, or fail(ERR_STATE).
local function stored(v)
  local n = tonumber(v)
  if n == nil or n ~= n then
    fail(ERR_STATE)
  end
  return n
end

-- The TTL each written key gets when the call ends, in ms from its job's
-- clock: one PEXPIRE per key and call, however many decisions wrote it.
-- The last decision's value wins, as it would in separate calls.
local expire_in = {}
local function set_ttl(key, ms)
  expire_in[key] = math.max(1, math.ceil(ms))
end

-- Within one call, what an algorithm read of a key, for the next check on
-- the same key. An entry is used only for the same algorithm, parameters
-- and clock, and any other algorithm's access to the key drops it.
local memo = {}

-- Set only by the peek script (peek.lua), which answers what a decision
-- would without writing anything: false in every other script. In peek
-- mode it is a table of the keys whose state a decision would replace
-- before reading it (another algorithm's state, an old-layout counter),
-- each with what the replacement would hold ({} = nothing); the peek
-- functions read that instead of the key and skip every write.
local READ_ONLY = false

-- Shared by the batch and the peek scripts: the ranges a check's
-- parameters must be in, and whose state a key holds.
local function whole(x, lo, hi)
  return x ~= nil and x >= lo and x <= hi and x == math.floor(x)
end

-- One check's algorithm and parameters, or fail(ERR_PARAMS).
local function params(a)
  local alg = tonumber(ARGV[a])
  local p1, p2 = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local cost = tonumber(ARGV[a + 3])
  if alg == 1 or alg == 2 then
    if whole(p1, 1, MAX_LIMIT) and whole(p2, 1, math.huge) and whole(cost, 1, p1) then
      return alg, p1, p2, cost
    end
  elseif alg == 3 then
    if p1 and p1 > 0 and p1 < math.huge and whole(p2, 1, math.huge) and whole(cost, 1, p2) then
      return alg, p1, p2, cost
    end
  end
  fail(ERR_PARAMS)
end

-- The message of an error caught by pcall (a table from redis.call, or a
-- string).
local function message(e)
  if type(e) == 'table' then
    return e.err
  end
  return e
end

-- Whether a caught error says a key holds another type than the one read.
local function wrong_type(e)
  local m = message(e)
  return type(m) == 'string' and string.sub(m, 1, 9) == 'WRONGTYPE'
end

-- Which algorithm's state a key of an unexpected type holds: 1, 2, 3,
-- 'legacy' (a fixed-window counter from before windows stored their
-- start), or nil (none of ours).
local function owner(key)
  local t = redis.call('TYPE', key)
  t = type(t) == 'table' and t.ok or t
  if t == 'list' then
    return 1
  elseif t == 'hash' then
    local h = redis.call('HMGET', key, 'start', 'tokens')
    if h[1] then
      return 2
    elseif h[2] then
      return 3
    end
  elseif t == 'string' and tonumber(redis.call('GET', key)) then
    return 'legacy'
  end
  return nil
end
