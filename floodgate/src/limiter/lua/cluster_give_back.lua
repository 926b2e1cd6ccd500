-- Redis Cluster: gives back what an allowed slot group of a request took
-- when another group of the same request denied it (or failed), so that a
-- denied request keeps no quota: give_back() of give_back_fn.lua on each
-- key. All keys are in one slot.
--
-- KEYS  the keys to give back
-- ARGV  per key, 5 values: algorithm (its code in ALGORITHMS,
--       see common.lua), p1, p2, cost, and a pinned clock in ms
--       ("" = Redis TIME)
-- Returns the number of keys seen.
local clock
for i, key in ipairs(KEYS) do
  local a = (i - 1) * 5
  local now = tonumber(ARGV[a + 5])
  if not now then
    if not clock then
      local t = redis.call('TIME')
      clock = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    now = clock
  end
  give_back(key, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
    tonumber(ARGV[a + 4]), now)
end
return #KEYS
