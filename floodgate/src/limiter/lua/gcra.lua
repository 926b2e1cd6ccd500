-- GCRA (generic cell rate algorithm).
-- KEY   a string "MS:FRACTION": the key's theoretical arrival time TAT, in
--       ms on the deciding clock (a whole part and a fraction, so that an
--       emission interval far below 1 ms is kept exactly at any epoch).
--       One number per key; the key expires at TAT.
-- p1    limit L: units admitted at once (1..MAX_LARGE_LIMIT)
-- p2    window W, ms: the time L units take to come back
-- cost  units c one request takes (1..L)
--
-- With the emission interval T = W / L and the tolerance tau = (L - 1) T, a
-- request is admitted when TAT + (c - 1) T - tau <= now, and then
-- TAT = max(TAT, now) + c T. It is computed in units of T relative to now,
-- x = (TAT - now) / T (x <= 0: nothing owed): admitted when
-- max(x, 0) + c <= L; remaining = floor(L - x); the wait of a denial is
-- (x + c - L) T; an admission's reset (and the TTL) is TAT - now. A tiny
-- slack (1e-6 of T, taken off waits) absorbs float rounding at exact
-- boundaries.
--
-- Time: TAT is never moved back, so a clock that steps back only finds
-- more owed (no room is made). A reload keeps TAT: the new L and W apply
-- to it at once (a shorter interval lets it drain faster).
define(4, 'string', nil, function()
  local GCRA_SLACK = 1e-6

  -- TAT of the state read at key, as whole ms and fraction, or nil.
  local function gcra_read(key)
    if READ_ONLY and READ_ONLY[key] then
      return nil
    end
    local v = redis.call('GET', key)
    if not v then
      return nil
    end
    local ms, frac = string.match(v, '^(%-?%d+):(.+)$')
    if not ms then
      -- A counter from before fixed windows stored their start: not ours,
      -- and the decision's SET replaces it.
      return nil
    end
    return stored(ms), stored(frac)
  end

  local function gcra_peek(key, now, limit, window, cost)
    forget(key)
    local t = window / limit
    local x = 0
    local ms, frac = gcra_read(key)
    if ms then
      x = math.max(0, ((ms - now) + frac) / t)
    end
    if x + cost <= limit + GCRA_SLACK then
      local owed = (x + cost) * t
      local remaining = math.max(0, math.floor(limit - x - cost + GCRA_SLACK))
      return true, remaining, owed - GCRA_SLACK * t, { owed, owed - GCRA_SLACK * t }
    end
    return false, math.max(0, math.floor(limit - x + GCRA_SLACK)), (x + cost - limit - GCRA_SLACK) * t, nil
  end

  local function gcra_commit(key, now, _, _, _, s)
    local owed = s[1]
    local whole_ms = math.floor(owed)
    redis.call('SET', key, string.format('%d:%.17g', now + whole_ms, owed - whole_ms))
    set_ttl(key, s[2])
  end

  -- Give-back: TAT moves back by the request's c T, never below now (a
  -- TAT at or before now is a fresh key): what is left owes at least what
  -- the other requests owe.
  local function gcra_give_back(key, now, limit, window, cost)
    local ms, frac = gcra_read(key)
    if not ms then
      return 0
    end
    local owed = (ms - now) + frac - cost * (window / limit)
    if owed <= 0 then
      redis.call('DEL', key)
    else
      local whole_ms = math.floor(owed)
      redis.call('SET', key, string.format('%d:%.17g', now + whole_ms, owed - whole_ms),
        'PX', math.max(1, math.ceil(owed)))
    end
    return cost
  end

  return {
    owns = function(v)
      return type(v) == 'string' and string.find(v, ':', 1, true) ~= nil
    end,
    valid = window_valid(MAX_LARGE_LIMIT),
    peek = gcra_peek,
    commit = gcra_commit,
    refills = true,
    give_back = gcra_give_back,
    quota = window_quota,
    override = window_override(MAX_LARGE_LIMIT),
  }
end)
