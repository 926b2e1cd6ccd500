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
