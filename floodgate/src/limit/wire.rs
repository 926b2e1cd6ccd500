//! The wire protocol between Rust and the Lua scripts: the script each call
//! runs, how checks are written as its arguments, and how its replies are
//! read back.

/// The Lua that Redis runs: one function per algorithm, then the batch driver.
pub const SCRIPT_SOURCE: &str = lua_with_algorithms!("lua/batch.lua");

/// Gives back what the allowed slot groups of a denied request took (a
/// Redis Cluster request whose rules span slots).
#[cfg(feature = "cluster")]
pub(crate) const CLUSTER_GIVE_BACK_SOURCE: &str =
    lua_with_algorithms!("lua/give_back_fn.lua", "lua/cluster_give_back.lua");
