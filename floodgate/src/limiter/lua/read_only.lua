-- A look at one key that writes nothing, for peek.lua and operator.lua
-- (loaded after common.lua and the algorithm files). The caller sets
-- READ_ONLY = {} first (see common.lua): where a decision would first
-- rewrite the key (another algorithm's state, an old-layout counter), the
-- answer is computed from what the key would then hold, and the key is left
-- as it is.

local function read_only_peek(alg, key, now, p1, p2, cost)
  local def = ALGORITHMS[alg]
  local ok, allowed, remaining, ms = pcall(def.peek, key, now, p1, p2, cost)
  if ok then
    return allowed, remaining, ms
  end
  if not wrong_type(allowed) then
    error(allowed, 0)
  end
  local who = owner(key)
  if who == nil or who == alg then
    fail(ERR_TYPE)
  end
  memo[key] = nil
  if who == 'legacy' and def.adopt then
    def.adopt(key, now, p2)
  else
    READ_ONLY[key] = {}
  end
  return def.peek(key, now, p1, p2, cost)
end
