-- Gives back the units of one request that was charged and then answered
-- well (a rule with count = "failures"): give_back() of give_back_fn.lua on
-- one key, outside the decision batch.
--
-- KEYS[1] the rule's key
-- ARGV    algorithm (its code in ALGORITHMS, see common.lua),
--         p1, p2 (as the algorithm's own file names them), cost
-- Returns the units given back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return give_back(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4]), now)
