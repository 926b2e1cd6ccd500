-- Redis Cluster: the batch driver above (wrapped in floodgate_batch) runs
-- one slot group of a batch. The clock is read once here and written into
-- every job that did not pin it, and returned as the last value, so that a
-- give-back (see cluster_give_back.lua) can find the sliding-window
-- entries this call pushed.
local t = redis.call('TIME')
local clock = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local at = 2
for _ = 1, tonumber(ARGV[1]) do
  if ARGV[at] == '' then
    ARGV[at] = clock
  end
  at = at + 2 + 5 * tonumber(ARGV[at + 1])
end
local decided = floodgate_batch()
decided[#decided + 1] = clock
return decided
