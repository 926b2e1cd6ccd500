-- Shared by the algorithms and the drivers; loaded first.
--
-- Time: every state remembers the time it was last written at on the clock
-- that decided it, and a decision never treats time as earlier than that
-- (now_eff = max(now, the state's time)), so a clock that steps back cannot
-- make room that the state does not have. Waits are answered on the
-- caller's clock (`now`), so that a retry after them is in time.
--
-- Errors: a check that cannot be decided raises fail(code); the driver fails
-- that request alone and decides the rest of the batch normally.
--
-- The globals used on every decision, read once as locals: a global is a
-- table lookup each time (a tenth of a decision's cost, measured).
local tonumber, type, pcall, unpack, math, string, redis =
  tonumber, type, pcall, unpack, math, string, redis
local max, floor, ceil = math.max, math.floor, math.ceil
local ERR_TYPE = 1 -- the key holds a Redis type no algorithm here writes
local ERR_PARAMS = 2 -- the check's parameters are out of range
local ERR_STATE = 3 -- the key's state is not made of numbers
local ERR_OTHER = 4 -- anything else (the message goes to the Redis log)

-- MAX_LIMIT, the largest limit a sliding-window log or fixed window may
-- have (and a bucket's burst; no log grows past it), and MAX_LARGE_LIMIT,
-- the largest of the algorithms whose state does not grow with it, are
-- defined before this file by the Rust side (units.rs), which checks rules
-- against the same numbers.

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
-- clock: one PEXPIRE per key and call, however many decisions wrote it
-- (rounded up, at least 1 ms, only then). The last decision's value wins,
-- as it would in separate calls.
local expire_in = {}
local function set_ttl(key, ms)
  expire_in[key] = ms
end

-- Within one call, what an algorithm read of a key, for the next check on
-- the same key. An entry is used only for the same algorithm, parameters
-- and clock, and any other algorithm's access to the key drops it.
-- An entry may hold writes not yet made (see the sliding window's): its
-- `flush` makes them. forget(key) makes them and drops the entry; the
-- batch flushes what is left when it ends.
local memo = {}
local function forget(key)
  local s = memo[key]
  if s and s.flush then
    s.flush(key, s)
  end
  memo[key] = nil
end

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

-- The algorithms, by their code on the wire (see limiter/algorithm.rs).
-- Each algorithm's file defines itself with define(code, kind, marker,
-- make):
--   kind       the Redis type of its state: 'list', 'hash' or 'string'
--   marker     (hash) a field only its state has
-- and make() returns its def:
--   owns(v)    (string) whether the value v is its state
--   valid(p1, p2, cost)              whether the parameters are in range
--   peek(key, now, p1, p2, cost)     allowed, remaining, ms, state
--   commit(key, now, p1, p2, cost, state)
--   give_back(key, now, p1, p2, cost)  units given back (see give_back_fn.lua)
--   quota(p1, p2)                    limit, window in ms (the RateLimit fields)
--   refills                          true when an admission's reset is the
--                                    time its units take to come back (token
--                                    bucket, GCRA): each unit adds window/limit
--   override(p1, p2, ol, ow)         the parameters under an operator's
--                                    override of limit ol, window ow (nil:
--                                    the rule's), or nil: it does not apply
--   adopt(key, now, p2)              optional: take over a legacy counter
--   again(key, now, p1, p2, cost, state)
--                                    optional: peek() of the same request
--                                    again, right after commit() admitted
--                                    one on `state` (same key, parameters
--                                    and clock, nothing read or written in
--                                    between), without reading: true,
--                                    remaining, ms exactly as peek() would
--                                    answer; or false (then peek() decides)
--   commit_again(key, now, p1, p2, cost, state)
--                                    with again(): commit() of the request
--                                    again() allowed, on the same `state`
-- ALGORITHMS[code] is the def, made on first use: every call runs the
-- whole script afresh, and most calls use one algorithm, so the others'
-- functions are never made. The batch, peek, give-back and operator
-- scripts read only this table (and KINDS).
local KINDS, MAKERS = {}, {}
local ALGORITHMS = setmetatable({}, {
  __index = function(t, code)
    local make = MAKERS[code]
    if not make then
      return nil
    end
    local def = make()
    def.kind, def.marker = KINDS[code].kind, KINDS[code].marker
    rawset(t, code, def)
    return def
  end,
})
local function define(code, kind, marker, make)
  KINDS[code] = { kind = kind, marker = marker }
  MAKERS[code] = make
end

-- valid() of an algorithm given by limit (1..max) and window in ms.
local function window_valid(max)
  return function(p1, p2, cost)
    return whole(p1, 1, max) and whole(p2, 1, math.huge) and whole(cost, 1, p1)
  end
end

-- quota() of an algorithm given by limit and window.
local function window_quota(p1, p2)
  return p1, p2
end

-- override() of an algorithm given by limit (at most max) and window.
local function window_override(max)
  return function(_, p2, ol, ow)
    if ol > max then
      return nil
    end
    return ol, ow or p2
  end
end

-- One check's algorithm and parameters, or fail(ERR_PARAMS).
local function params(a)
  local alg = tonumber(ARGV[a])
  local p1, p2 = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local cost = tonumber(ARGV[a + 3])
  local def = alg and ALGORITHMS[alg]
  if def and def.valid(p1, p2, cost) then
    return alg, p1, p2, cost
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

-- Which algorithm's state a key of an unexpected type holds: its code,
-- 'legacy' (a fixed-window counter from before windows stored their
-- start: a plain integer), or nil (none of ours).
local function owner(key)
  local t = redis.call('TYPE', key)
  t = type(t) == 'table' and t.ok or t
  local v = t == 'string' and redis.call('GET', key)
  for code, k in ipairs(KINDS) do
    if k.kind == t then
      if t == 'list' or (t == 'string' and ALGORITHMS[code].owns(v))
        or (t == 'hash' and redis.call('HEXISTS', key, k.marker) == 1) then
        return code
      end
    end
  end
  if v and tonumber(v) then
    return 'legacy'
  end
  return nil
end

-- One check's peek, as every script makes it: the algorithm's own, or,
-- when the key holds another algorithm's state (a reload changed the
-- rule's algorithm) or an old-layout counter, the peek of what a decision
-- first makes of it: the counter adopted, or the key started afresh
-- (deleted; in READ_ONLY mode only noted, see above). Returns allowed,
-- remaining, ms and the state the algorithm's commit reuses.
local function peek_check(alg, key, now, p1, p2, cost)
  local def = ALGORITHMS[alg]
  local s = memo[key]
  if s and s.alg == alg then
    -- Read as this algorithm's state earlier in the call: no other type
    -- can be there, so nothing to catch.
    return def.peek(key, now, p1, p2, cost)
  end
  local ok, allowed, remaining, ms, state = pcall(def.peek, key, now, p1, p2, cost)
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
  forget(key)
  if who == 'legacy' and def.adopt then
    def.adopt(key, now, p2)
  elseif READ_ONLY then
    READ_ONLY[key] = {}
  else
    redis.call('DEL', key)
  end
  return def.peek(key, now, p1, p2, cost)
end

-- The fields read by hash_read for each algorithm: its own, then the
-- markers of every other hash algorithm.
local hash_fields = {}

-- Reads `fields` of algorithm `code`'s hash at `key`, as HMGET does. A key
-- holding another algorithm's hash (a reload changed the rule's algorithm)
-- reads as nothing, and a decision deletes it. In peek mode what a
-- decision would first have made of the key is read instead (READ_ONLY).
local function hash_read(key, code, fields)
  if READ_ONLY and READ_ONLY[key] then
    return READ_ONLY[key]
  end
  local all = hash_fields[code]
  if not all then
    all = {}
    for i = 1, #fields do
      all[i] = fields[i]
    end
    for c, k in ipairs(KINDS) do
      if c ~= code and k.kind == 'hash' then
        all[#all + 1] = k.marker
      end
    end
    hash_fields[code] = all
  end
  local h = redis.call('HMGET', key, unpack(all))
  for i = #fields + 1, #all do
    if h[i] then
      if not READ_ONLY then
        redis.call('DEL', key)
      end
      return {}
    end
  end
  return h
end

-- A give-back of up to `cost` of the `have` units a hash algorithm counts
-- in `field` of key: returns how many it gave back.
local function hash_give_back(key, field, have, cost)
  local back = math.min(have, cost)
  if back > 0 then
    redis.call('HINCRBY', key, field, -back)
  end
  return back
end

-- Operator state: beside each state key KEY, the hash '!' .. KEY (the same
-- hash tag on a Cluster, so the same slot; no state key starts with '!',
-- which key_prefix may not) holds what operators and penalties set for the
-- identity, as times in ms on the deciding clock:
--   ban, by   the ban's end, and who set it ('operator' or 'penalty')
--   ol, ow, oe  an override: limit (token bucket: burst), window in ms
--             (absent: the rule's), end (absent: none)
--   pc, pce   penalty: denials counted, and when that count is forgotten
--   lv, lve   penalty: bans so far, and when they are forgotten
-- The hash lives as long as its longest part (no TTL while an override
-- without an end holds). The batch asks once whether any of its records
-- exists (ops_any), then reads each that may with one HMGET, in this order:
local OPS_FIELDS = { 'ban', 'ol', 'ow', 'oe', 'pc', 'pce', 'lv', 'lve' }

-- What ops_read answers when no record exists: never written to (a
-- penalty writes into a table of its own).
local OPS_NONE = {}

local function ops_key(key)
  return '!' .. key
end

-- False once the caller knows that no record it will read exists (the
-- batch asks once for all its keys); any write of a record sets it again.
local ops_maybe = true

-- Starts one call: forgets what the last call knew. A script sent by
-- EVAL is run afresh each time, but a function library (FCALL, see
-- limiter/program.rs) keeps its locals from call to call, so every
-- driver's entry calls this first.
local function begin()
  expire_in, memo, ops_maybe = {}, {}, true
end

local function ops_read(key)
  if not ops_maybe then
    return OPS_NONE
  end
  return redis.call('HMGET', ops_key(key), unpack(OPS_FIELDS))
end

-- Whether any of `keys` has an operator record: one EXISTS per 1000
-- distinct keys (a call mostly decides a few keys many times).
local function ops_any(keys)
  local names, seen = {}, {}
  local n = #keys
  for i = 1, n do
    local key = keys[i]
    if not seen[key] then
      seen[key] = true
      names[#names + 1] = ops_key(key)
    end
    if #names == 1000 or (i == n and #names > 0) then
      if redis.call('EXISTS', unpack(names)) > 0 then
        return true
      end
      names = {}
    end
  end
  return false
end

-- Ms left on the ban at `now`, or nil.
local function ops_banned(op, now)
  local ends = tonumber(op[1])
  if ends and ends > now then
    return ends - now
  end
  return nil
end

-- The override in force at `now`: limit, window ms or nil, end or nil.
local function ops_override(op, now)
  local ol = tonumber(op[2])
  if not ol then
    return nil
  end
  local oe = tonumber(op[4])
  if oe and oe <= now then
    return nil
  end
  return ol, tonumber(op[3]), oe
end

-- The check's parameters with the identity's override applied: windows
-- take its limit and window; a token bucket takes its limit as the burst,
-- and its rate scales with it (or refills the burst in its window). An
-- override that does not fit the check's cost is not applied. The third
-- value says whether it was; the fourth is when it ends (nil: never).
local function ops_params(op, alg, p1, p2, cost, now)
  local ol, ow, oe = ops_override(op, now)
  if not ol or ol < cost or ol ~= math.floor(ol) then
    return p1, p2, false
  end
  local q1, q2 = ALGORITHMS[alg].override(p1, p2, ol, ow)
  if not q1 then
    return p1, p2, false
  end
  return q1, q2, true, oe
end

-- Ms until the last part of the record ends (nil: a part never ends),
-- from its fields after a write, indexed as OPS_FIELDS.
local function ops_lifetime(op, now)
  local last = now
  if op[2] and not op[4] then
    return nil
  end
  for _, i in ipairs({ 1, 4, 6, 8 }) do
    local t = tonumber(op[i])
    if t and t > last then
      last = t
    end
  end
  return last - now
end

-- A check's flags: "1" / "0" (enforce / shadow), or "1:AFTER:WITHIN:BAN:MAX"
-- with the rule's penalty (durations in ms). Returns enforce, penalty.
local function check_flags(v)
  if #v == 1 then
    return v == '1', nil
  end
  local e, after, within, ban, max = string.match(v, '^([01]):(%d+):(%d+):(%d+):(%d+)$')
  if not e then
    fail(ERR_PARAMS)
  end
  return e == '1', { tonumber(after), tonumber(within), tonumber(ban), tonumber(max) }
end

-- One more denial of the identity under a rule with penalty `pen`: counts
-- it, and when it is the AFTER-th within WITHIN, bans the identity for BAN
-- doubled for each ban still remembered (at most MAX). Returns the ban's
-- length in ms, or nil. The record's fields in `op` are updated as written;
-- the caller sets its TTL from them.
local function ops_penalize(key, op, pen, now)
  local after, within, ban, max = pen[1], pen[2], pen[3], pen[4]
  local okey = ops_key(key)
  ops_maybe = true
  local pc, pce = tonumber(op[5]), tonumber(op[6])
  if not (pc and pce and pce > now) then
    pc, pce = 0, now + within
  end
  pc = pc + 1
  if pc < after then
    redis.call('HSET', okey, 'pc', pc, 'pce', pce)
    op[5], op[6] = pc, pce
    return nil
  end
  local lv, lve = tonumber(op[7]), tonumber(op[8])
  if not (lv and lve and lve > now) then
    lv = 0
  end
  local length = ban
  for _ = 1, lv do
    if length >= max then
      break
    end
    length = length * 2
  end
  length = math.min(length, max)
  local ends = now + length
  redis.call('HSET', okey, 'ban', ends, 'by', 'penalty', 'lv', lv + 1, 'lve', ends + max)
  redis.call('HDEL', okey, 'pc', 'pce')
  op[1], op[5], op[6], op[7], op[8] = ends, nil, nil, lv + 1, ends + max
  return length
end
