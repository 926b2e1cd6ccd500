-- give_back(key, alg, p1, p2, cost, now): gives back the units one request
-- took from one key; returns the units given back. Loaded after common.lua
-- and the algorithm files: each algorithm's give_back (see ALGORITHMS in
-- common.lua). Used by give_back.lua (count = "failures") and
-- cluster_give_back.lua (a request denied by another slot group).
--
-- Only ever in the safe direction, and with the same bounded work as a
-- decision (no loop over entries); each algorithm's file says how. A key
-- holding another algorithm's state is left alone. Time is never earlier
-- than the state's own, as in a decision. The identity's override in force
-- applies, as in a decision (ops_params): a give-back under the rule's own
-- numbers would cut a log at the rule's window, move GCRA's clock back by
-- the rule's interval, or rewrite a bucket with the rule's rate and burst.
local function give_back(key, alg, p1, p2, cost, now)
  local def = alg and ALGORITHMS[alg]
  if not def then
    return 0
  end
  local t = redis.call('TYPE', key)
  t = type(t) == 'table' and t.ok or t
  if t ~= def.kind then
    return 0
  end
  p1, p2 = ops_params(ops_read(key), alg, p1, p2, cost, now)
  return def.give_back(key, now, p1, p2, cost)
end
