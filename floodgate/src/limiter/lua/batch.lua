-- Decides a batch of requests, in order, in one atomic call: batch(), at
-- the end, decides one call (EVAL's script ends with `return batch()`; the
-- function library calls it, see limiter/program.rs).
-- Each request ("job") has one check per matching rule. A job is allowed
-- only if every enforce check allows it, and only then are its checks
-- recorded (a denied request takes no quota from any rule).
--
-- KEYS  one key per check, jobs one after another
-- ARGV  [1] number of specs, then per spec (what checks of the call share;
--         each is written once, or a few times in a call of many):
--           algorithm (its code in ALGORITHMS, see common.lua),
--           p1, p2 (see each algorithm), cost, flags: enforce (1) or
--           shadow (0), then for a rule with a penalty
--           ":AFTER:WITHIN_MS:BAN_MS:MAX_MS" (see common.lua),
--       then the number of jobs, then per job ONE argument,
--         "DEADLINE|SPECS" (the jobs of a call mostly share one, read once,
--         and each argument costs Redis a string): DEADLINE in ms on
--         Redis's clock (empty = none): a job that reaches Redis at or
--         after it is skipped, because its caller has given up; SPECS, per
--         check the number of its spec (from 1), joined by commas.
--         A negative number of jobs (tests pinning the clock): each job's
--         argument is followed by a clock override in ms ("" = Redis TIME)
-- Returns a flat array (packed in one string, see packed()), three values
-- per check:
--   decided:  allowed (1), denied (0), denied by a ban (2), denied by a
--             ban this denial started (3); remaining, ms
--             (ms: retry-after when denied, time to reset when allowed)
--   failed:   -1, error code (see common.lua), index of the failing check
--             within its job (every check of a failed job says the same)
--   skipped:  -2, 0, 0 (past its deadline: nothing read, nothing recorded)
-- then Redis's clock in microseconds (the dispatcher keeps its estimate
-- of Redis time from it), and, last, three values for each check decided
-- under an operator's override (none in the common case): the check's
-- index among KEYS from 0, the override's limit (token bucket: burst) and
-- its window in ms (token bucket: time to refill from empty).
-- A check denied under an override that ends before the wait it would
-- answer is over answers at most what the rule's own numbers would then
-- answer: min(wait under the override, max(time to its end, wait under
-- the rule)), so a Retry-After (and a cached denial) never outlives it.
-- A job that fails (a key of a type no algorithm writes, parameters out of
-- range, unreadable state) fails alone: it records nothing, and the other
-- jobs are decided as if it had not been there. A key that holds another
-- algorithm's state (a reload changed the rule's algorithm) is started
-- afresh. Every key written gets its TTL before the call returns.
-- On a Redis Cluster one call
-- decides the jobs of every slot a master serves (the cluster's copy of
-- this script is flagged allow-cross-slot-keys): KEYS is then empty, and
-- ARGV starts with 'cluster', the number of slots, then per slot a key of
-- that slot that is never written, the number of keys and the keys (see
-- dispatch/cluster/groups.rs); ARGV[1] above comes after them.
--
-- batch() decides one call; the per-call values below are set by it.
-- The keys, and where the jobs start in ARGV (see above).
local keys, base
-- Redis's clock, read once: every job of the call is decided at this
-- moment (ms, and us for the reply).
local clock, clock_us
-- The reply being built.
local out
-- The check being decided, counted from 0 within its job (for errors).
local failing
-- Index, limit, window ms of each check decided under an override.
local quotas

local peek = peek_check

-- The call's check specs (see ARGV above): where they start in ARGV, how
-- many there are, and those parsed so far, by the argument that names them.
local spec_base, spec_count, spec_parsed

-- Specs parsed by earlier calls, by their five arguments: most calls send
-- the same few. Kept from call to call by the function library, and
-- started afresh once it holds SPECS_MOST; never written into.
local SPECS_MOST = 1024
local specs_seen, specs_n = {}, 0

-- The spec a check names (its argument, "1" for the first), parsed on
-- first use: alg, p1, p2, cost, enforce, penalty; or fail(ERR_PARAMS).
local function spec(name)
  local c = spec_parsed[name]
  if c then
    return c[1], c[2], c[3], c[4], c[5], c[6]
  end
  local i = tonumber(name)
  if not i or i < 1 or i > spec_count or i ~= math.floor(i) then
    fail(ERR_PARAMS)
  end
  local a = spec_base + 5 * (i - 1)
  local text = ARGV[a] .. ' ' .. ARGV[a + 1] .. ' ' .. ARGV[a + 2] .. ' ' .. ARGV[a + 3]
    .. ' ' .. ARGV[a + 4]
  c = specs_seen[text]
  if not c then
    local alg, p1, p2, cost = params(a)
    local enforce, pen = check_flags(ARGV[a + 4])
    c = { alg, p1, p2, cost, enforce, pen }
    if specs_n >= SPECS_MOST then
      specs_seen, specs_n = {}, 0
    end
    specs_seen[text], specs_n = c, specs_n + 1
  end
  spec_parsed[name] = c
  return c[1], c[2], c[3], c[4], c[5], c[6]
end

-- The wait of a denial under an override that ends at `ends` (nil: never):
-- no longer than until the rule's own numbers (r1, r2) would allow. It only
-- asks: the rule's numbers are not in force yet, so nothing they would
-- write (a log's TTL, a window's length, a bucket's rate) is written.
local function wait_under(ms, ends, alg, key, now, r1, r2, cost)
  if not ends or ends - now >= ms then
    return ms
  end
  local ttl, was = expire_in[key], READ_ONLY
  READ_ONLY = {}
  local ok, allowed, _, rule_ms = pcall(peek, alg, key, now, r1, r2, cost)
  READ_ONLY, expire_in[key] = was, ttl
  if not ok then
    error(allowed, 0)
  end
  if allowed then
    rule_ms = 0
  end
  return math.min(ms, math.max(ends - now, rule_ms))
end

-- Notes that the check at KEYS[k] was decided under an override, with
-- parameters p1, p2.
local function decided_under(k, alg, p1, p2)
  local n = #quotas
  quotas[n + 1] = k - 1
  local limit, window = ALGORITHMS[alg].quota(p1, p2)
  quotas[n + 2], quotas[n + 3] = limit, math.ceil(window)
end

-- code: 1 allowed, 0 denied, 2 denied by a ban, 3 denied by a ban that
-- this very denial started (a penalty).
-- (x - x % 1 is floor(x), x + -x % 1 is ceil(x): Lua arithmetic, no
-- function call.)
local function emit(k, code, remaining, ms)
  local at = 3 * k - 2
  out[at] = code
  remaining = remaining - remaining % 1
  out[at + 1] = remaining > 0 and remaining or 0
  ms = ms + -ms % 1
  out[at + 2] = ms > 0 and ms or 0
end

-- The TTL of an operator record the decision wrote.
local function ops_written(key, op, now)
  local ms = ops_lifetime(op, now)
  if ms then
    set_ttl(ops_key(key), ms)
  end
end

-- The job just decided, when it was admitted whole, no operator record
-- was on its keys (all different), and each check's algorithm has again()
-- (see common.lua): its number of checks (0: no such job), its clock, and
-- per check its spec's name, key, state, algorithm and parameters. The
-- same request again (a busy identity's next request in the batch) is
-- then decided by again() and commit_again(), without reading what the
-- call already knows. Any other job clears it.
local rep_n, rep_now = 0, nil
local rep_names, rep_keys, rep_states, rep_defs = {}, {}, {}, {}
local rep_p1, rep_p2, rep_cost = {}, {}, {}
local rep_left, rep_ms = {}, {}

-- Notes check i of the job just admitted (see rep_n).
local function repeatable(i, name, key, state, def, p1, p2, cost)
  rep_names[i], rep_keys[i], rep_states[i], rep_defs[i] = name, key, state, def
  rep_p1[i], rep_p2[i], rep_cost[i] = p1, p2, cost
end

-- Decides the job (n checks: KEYS from k, their specs named in `names`)
-- when it is the one just admitted again and every check allows it
-- again: true. Otherwise false, and nothing was done. (No operator record
-- can have appeared since: only a denial writes one.)
local function decide_again(n, now, k, names)
  if now ~= rep_now then
    return false
  end
  if n == 1 then
    -- (The common case, without the loops.)
    local key = keys[k]
    if names[1] ~= rep_names[1] or key ~= rep_keys[1] then
      return false
    end
    local def, p1, p2, cost, state = rep_defs[1], rep_p1[1], rep_p2[1], rep_cost[1], rep_states[1]
    local allowed, remaining, ms = def.again(key, now, p1, p2, cost, state)
    if not allowed then
      return false
    end
    def.commit_again(key, now, p1, p2, cost, state)
    emit(k, 1, remaining, ms)
    return true
  end
  for i = 1, n do
    if names[i] ~= rep_names[i] or keys[k + i - 1] ~= rep_keys[i] then
      return false
    end
  end
  for i = 1, n do
    local allowed, remaining, ms =
      rep_defs[i].again(rep_keys[i], now, rep_p1[i], rep_p2[i], rep_cost[i], rep_states[i])
    if not allowed then
      return false
    end
    rep_left[i], rep_ms[i] = remaining, ms
  end
  for i = 1, n do
    rep_defs[i].commit_again(rep_keys[i], now, rep_p1[i], rep_p2[i], rep_cost[i], rep_states[i])
    emit(k + i - 1, 1, rep_left[i], rep_ms[i])
  end
  return true
end

-- Decides the n checks of one job: KEYS from k, their specs named in
-- `names`.
-- Each check first reads its identity's operator record: a ban denies it
-- (and, for an enforce check, the whole request, which then records
-- nothing at all), an override replaces the rule's numbers.
-- The several-rules path keeps its checks here, one table per check reused
-- from job to job (and, in the function library, from call to call).
local scratch = {}
local function decide_job(n, now, k, names)
  if rep_n == n and decide_again(n, now, k, names) then
    return
  end
  rep_n = 0
  if n == 1 then
    -- One rule (the common case): no bookkeeping across checks.
    failing = 0
    local name, key = names[1], keys[k]
    local alg, p1, p2, cost, enforce, pen = spec(name)
    local op = ops_read(key)
    local r1, r2 = p1, p2
    local applied, ends
    if op ~= OPS_NONE then
      local banned = ops_banned(op, now)
      if banned then
        emit(k, 2, 0, banned)
        return
      end
      p1, p2, applied, ends = ops_params(op, alg, p1, p2, cost, now)
      if applied then
        decided_under(k, alg, p1, p2)
      end
    end
    local allowed, remaining, ms, state = peek(alg, key, now, p1, p2, cost)
    if allowed then
      local def = ALGORITHMS[alg]
      def.commit(key, now, p1, p2, cost, state)
      emit(k, 1, remaining, ms)
      if op == OPS_NONE and def.again then
        repeatable(1, name, key, state, def, p1, p2, cost)
        rep_n, rep_now = 1, now
      end
      return
    end
    if applied then
      ms = wait_under(ms, ends, alg, key, now, r1, r2, cost)
    end
    if enforce and pen then
      if op == OPS_NONE then
        op = {} -- ops_penalize writes into it
      end
      local ban = ops_penalize(key, op, pen, now)
      ops_written(key, op, now)
      if ban then
        emit(k, 3, 0, ban)
        return
      end
    end
    emit(k, 0, remaining, ms)
    return
  end
  -- Several rules: peek every check, commit them all only if every
  -- enforce check allows and none is banned.
  local checks = scratch
  local all_enforced_allow = true
  local any_banned = false
  for i = 1, n do
    failing = i - 1
    local alg, p1, p2, cost, enforce, pen = spec(names[i])
    local key = keys[k + i - 1]
    local op = ops_read(key)
    local banned = op ~= OPS_NONE and ops_banned(op, now)
    local c = checks[i]
    if not c then
      c = {}
      checks[i] = c
    end
    if banned then
      c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12], c[13] =
        key, alg, p1, p2, cost, false, 0, banned, nil, enforce, pen, op, 2
      if enforce then
        all_enforced_allow = false
        any_banned = true
      end
    else
      local r1, r2 = p1, p2
      local applied, ends
      if op ~= OPS_NONE then
        p1, p2, applied, ends = ops_params(op, alg, p1, p2, cost, now)
        if applied then
          decided_under(k + i - 1, alg, p1, p2)
        end
      end
      local allowed, remaining, ms, state = peek(alg, key, now, p1, p2, cost)
      if applied and not allowed then
        ms = wait_under(ms, ends, alg, key, now, r1, r2, cost)
      end
      c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12], c[13] =
        key, alg, p1, p2, cost, allowed, remaining, ms, state, enforce, pen, op, allowed and 1 or 0
      if enforce and not allowed then
        all_enforced_allow = false
      end
    end
  end
  for i = 1, n do
    failing = i - 1
    local c = checks[i]
    if all_enforced_allow and c[6] then
      ALGORITHMS[c[2]].commit(c[1], now, c[3], c[4], c[5], c[9])
    elseif c[13] == 0 and c[10] and c[11] and not any_banned then
      -- Denied by its own limit: one more denial towards a penalty.
      if c[12] == OPS_NONE then
        c[12] = {}
      end
      local ban = ops_penalize(c[1], c[12], c[11], now)
      ops_written(c[1], c[12], now)
      if ban then
        c[13], c[7], c[8] = 3, 0, ban
      end
    end
    emit(k + i - 1, c[13], c[7], c[8])
  end
  if not all_enforced_allow then
    return
  end
  for i = 1, n do
    local c = checks[i]
    if not (c[6] and c[12] == OPS_NONE and ALGORITHMS[c[2]].again) then
      return
    end
    for j = 1, i - 1 do
      if checks[j][1] == c[1] then
        return
      end
    end
  end
  for i = 1, n do
    local c = checks[i]
    repeatable(i, names[i], c[1], c[9], ALGORITHMS[c[2]], c[3], c[4], c[5])
  end
  rep_n, rep_now = n, now
end

-- The reply as one string, each value a little-endian 8-byte integer
-- (struct truncates toward zero, as Redis does a number it returns): one
-- string costs Redis less to send, and the dispatcher far less to read,
-- than an array of as many integers. Packed PACK_CHUNK values at a time
-- (unpack has a bound; a call of fewer, nearly all, packs in one go), each
-- chunk's format made once.
local PACK_CHUNK = 500
local pack_formats = {}
local function pack_format(m)
  local format = pack_formats[m]
  if not format then
    format = '<' .. string.rep('i8', m)
    pack_formats[m] = format
  end
  return format
end
local function packed(values)
  local n = #values
  if n <= PACK_CHUNK then
    return struct.pack(pack_format(n), unpack(values))
  end
  local parts = {}
  for i = 1, n, PACK_CHUNK do
    local m = math.min(PACK_CHUNK, n - i + 1)
    parts[#parts + 1] = struct.pack(pack_format(m), unpack(values, i, i + m - 1))
  end
  return table.concat(parts)
end

-- Decides the call's jobs: the reply described above.
local function batch()
  begin()
  keys, base, rep_n = KEYS, 0, 0
  local time = redis.call('TIME')
  clock_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
  clock = math.floor(clock_us / 1000)
  out, failing, quotas = {}, 0, {}

  -- Most identities have no operator record: one EXISTS for the whole call
  -- (each key named once) spares every check its HMGET then.
  if ARGV[1] == 'cluster' then
    -- Before anything is written, every slot must be served here and not
    -- be on the move: only then does its never-written key answer (a slot
    -- served elsewhere, migrating or importing answers MOVED, ASK or
    -- TRYAGAIN for it). Otherwise nothing at all is done, and the
    -- dispatcher sends the slots one by one. The same EXISTS asks whether
    -- any of the slot's identities has an operator record.
    keys = {}
    local at, any, seen = 3, false, {}
    for _ = 1, tonumber(ARGV[2]) do
      local m = tonumber(ARGV[at + 1])
      local names = { ARGV[at] }
      for i = at + 2, at + 1 + m do
        local key = ARGV[i]
        keys[#keys + 1] = key
        if not seen[key] then
          seen[key] = true
          names[#names + 1] = ops_key(key)
        end
        if #names == 1000 or i == at + 1 + m then
          local ok, found = pcall(redis.call, 'EXISTS', unpack(names))
          if not ok then
            return { -3 }
          end
          any = any or found > 0
          names = { ARGV[at] }
        end
      end
      at = at + 2 + m
    end
    base = at - 1
    ops_maybe = any
  else
    ops_maybe = ops_any(KEYS)
  end

  spec_count, spec_base, spec_parsed = tonumber(ARGV[base + 1]), base + 2, {}
  base = base + 1 + 5 * spec_count
  local a = base + 2
  local k = 1
  -- The last job text read, and what it says (see ARGV above): the jobs of
  -- a call mostly share one.
  local job_text, deadline, names, n = nil, nil, nil, 0
  local jobs = tonumber(ARGV[base + 1])
  local pinning = jobs < 0
  if pinning then
    jobs = -jobs
  end
  for _ = 1, jobs do
    local text = ARGV[a]
    if text ~= job_text then
      -- (Found, not matched: a pattern costs a one-request call more.)
      local bar = string.find(text, '|', 1, true)
      if not bar then
        error('floodgate: a job written as ' .. text, 0)
      end
      local specs = string.sub(text, bar + 1)
      job_text, deadline = text, tonumber(string.sub(text, 1, bar - 1))
      if string.find(specs, ',', 1, true) then
        names = {}
        for name in string.gmatch(specs, '[^,]+') do
          names[#names + 1] = name
        end
      else
        names = { specs }
      end
      n = specs == '' and 0 or #names
    end
    local now = clock
    if pinning then
      a = a + 1
      now = tonumber(ARGV[a]) or clock
    end
    local ok, e = true, nil
    local noted = #quotas
    if deadline and clock >= deadline then
      -- Its caller has stopped waiting: decide nothing.
      for i = k, k + n - 1 do
        local at = 3 * i - 2
        out[at], out[at + 1], out[at + 2] = -2, 0, 0
      end
    else
      ok, e = pcall(decide_job, n, now, k, names)
    end
    if not ok then
      local code = type(e) == 'table' and e.floodgate
      if not code then
        code = ERR_OTHER
        redis.log(redis.LOG_WARNING, 'floodgate: the check on ' .. tostring(keys[k + failing])
          .. ' failed: ' .. tostring(message(e)))
      end
      for i = k, k + n - 1 do
        local at = 3 * i - 2
        out[at], out[at + 1], out[at + 2] = -1, code, failing
      end
      for i = #quotas, noted + 1, -1 do
        quotas[i] = nil
      end
    end
    a = a + 1
    k = k + n
  end
  -- Writes the decisions kept back (see forget in common.lua), then the TTLs.
  for key, s in pairs(memo) do
    if s.flush then
      s.flush(key, s)
    end
  end
  for key, ms in pairs(expire_in) do
    redis.call('PEXPIRE', key, max(1, ceil(ms)))
  end
  out[3 * (k - 1) + 1] = clock_us
  for i = 1, #quotas do
    out[3 * (k - 1) + 1 + i] = quotas[i]
  end
  return packed(out)
end
