-- A look at one key that writes nothing, for peek.lua and operator.lua
-- (loaded after common.lua and the algorithm files). The caller sets
-- READ_ONLY = {} first (see common.lua): where a decision would first
-- rewrite the key (another algorithm's state, an old-layout counter), the
-- answer is computed from what the key would then hold, and the key is left
-- as it is.

-- (common.lua's peek_check notes such a key in READ_ONLY instead.)
local read_only_peek = peek_check
