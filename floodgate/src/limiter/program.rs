//! How the batch script reaches Redis: as a function library (Redis 7's
//! `FUNCTION LOAD`, called with `FCALL`), or as a script (`EVALSHA`).
//!
//! A script sent by `EVALSHA` runs its whole source on every call: each of
//! its helper functions is made again, and that is most of what a call
//! with one decision costs Redis. A library runs its source once, when it
//! is loaded; its functions then only decide. So every dispatcher calls
//! the library first, and falls back to the script, for good, where Redis
//! refuses it (Redis 6 has no functions; an ACL may deny them).
//!
//! The library's name carries the script's SHA1, so two builds of floodgate
//! on one Redis (a rolling deploy) each call their own. Like a script, a
//! library can be missing from the server a call reaches (a new server,
//! `FUNCTION FLUSH`): Redis answers that the function is not found, runs
//! nothing, and the dispatcher loads the library and sends the same call
//! again. Unlike scripts, Redis keeps libraries in its RDB and AOF files and
//! sends them to its replicas, so a promoted replica already has them.

use std::sync::OnceLock;

use redis::{ErrorKind, RedisError, ServerErrorKind};

#[cfg(feature = "cluster")]
use super::wire::CLUSTER_SCRIPT_SOURCE;
use super::wire::SCRIPT_SOURCE;

/// The batch script in its two forms.
pub(crate) struct Program {
    /// The script (`EVALSHA`): for servers that refuse functions.
    script: redis::Script,
    /// The script flagged `allow-cross-slot-keys`, likewise.
    #[cfg(feature = "cluster")]
    cluster_script: redis::Script,
    /// The library's source, for `FUNCTION LOAD`.
    library: String,
    /// The batch function's name.
    function: String,
    /// The same function flagged `allow-cross-slot-keys`, for a Redis
    /// Cluster master's call over every slot it serves.
    #[cfg(feature = "cluster")]
    cluster_function: String,
}

/// How a dispatcher ships the batch script: it starts with
/// [`Shipping::Function`] and keeps [`Shipping::Script`] once Redis has
/// refused the library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shipping {
    /// `FCALL` of the library's function.
    Function,
    /// `EVALSHA` of the script.
    Script,
}

/// What an error answered to a batch call means: the call ran nothing in
/// each case, so it may be sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Missing {
    /// `NOSCRIPT`: the script is to be loaded.
    Script,
    /// The function is not found: the library is to be loaded.
    Function,
    /// Redis has no `FCALL`, or the connection's user may not use it.
    Functions,
}

impl Program {
    /// The batch script, built once.
    pub(crate) fn batch() -> &'static Program {
        static PROGRAM: OnceLock<Program> = OnceLock::new();
        PROGRAM.get_or_init(|| Program::new(SCRIPT_SOURCE))
    }

    /// `source` ends with `return batch()`: the library runs the rest once
    /// and calls `batch()` on each call.
    fn new(source: &str) -> Program {
        let script = redis::Script::new(source);
        let id = &script.get_hash()[..16];
        let body = source.trim_end();
        let body = body.strip_suffix("return batch()").unwrap_or(body);
        let function = format!("floodgate_batch_{id}");
        let cluster_function = format!("floodgate_cluster_batch_{id}");
        // The flagged function is there on one server too: one library for both.
        // Redis runs a library's source with nothing but
        // `redis.register_function` at hand (no `setmetatable`, no
        // `ipairs`), so the script's own top level runs in `init`, on the
        // first call. The locals KEYS and ARGV stand in for EVAL's globals.
        let library = format!(
            "#!lua name=floodgate_{id}\n\
             local KEYS, ARGV\n\
             local function init()\n{body}\nreturn batch\nend\n\
             local batch\n\
             local function call(keys, args)\n\
             \x20 KEYS, ARGV = keys, args\n\
             \x20 if not batch then\n\
             \x20   batch = init()\n\
             \x20 end\n\
             \x20 return batch()\n\
             end\n\
             redis.register_function('{function}', call)\n\
             redis.register_function{{ function_name = '{cluster_function}', callback = call, \
             flags = {{ 'allow-cross-slot-keys' }} }}\n"
        );
        Program {
            script,
            #[cfg(feature = "cluster")]
            cluster_script: redis::Script::new(CLUSTER_SCRIPT_SOURCE),
            library,
            function,
            #[cfg(feature = "cluster")]
            cluster_function,
        }
    }

    /// The command and name a call of the batch begins with.
    pub(crate) fn target(&self, shipping: Shipping) -> (&'static str, &str) {
        match shipping {
            Shipping::Function => ("FCALL", &self.function),
            Shipping::Script => ("EVALSHA", self.script.get_hash()),
        }
    }

    /// As [`Program::target`], for a Redis Cluster master's call over
    /// every slot it serves.
    #[cfg(feature = "cluster")]
    pub(crate) fn cluster_target(&self, shipping: Shipping) -> (&'static str, &str) {
        match shipping {
            Shipping::Function => ("FCALL", &self.cluster_function),
            Shipping::Script => ("EVALSHA", self.cluster_script.get_hash()),
        }
    }

    /// The sources of the scripts (`EVALSHA`) of both forms.
    #[cfg(feature = "cluster")]
    pub(crate) fn script_sources(&self) -> [&'static str; 2] {
        [SCRIPT_SOURCE, CLUSTER_SCRIPT_SOURCE]
    }

    /// The batch function's name.
    pub(crate) fn function(&self) -> &str {
        &self.function
    }

    /// The library's source, as `FUNCTION LOAD` takes it.
    pub(crate) fn library(&self) -> &str {
        &self.library
    }

    /// Loads what `missing` says is missing on `conn`: the library or the
    /// script. Returns how the batch is to be shipped from now on: the
    /// script, when Redis refuses the library (logged once per dispatcher:
    /// the caller keeps the answer).
    pub(crate) fn load<C: redis::ConnectionLike>(
        &self,
        conn: &mut C,
        missing: Missing,
    ) -> Result<Shipping, RedisError> {
        if missing == Missing::Function {
            match load_library(conn, &self.library) {
                Ok(()) => return Ok(Shipping::Function),
                Err(e) if refuses_functions(&e) => log::warn!(
                    "redis refused floodgate's function library ({e}); deciding with EVALSHA instead"
                ),
                // Anything else (out of memory, loading, a broken link) may
                // pass: the next call tries again.
                Err(e) => return Err(e),
            }
        } else if missing == Missing::Functions {
            log::warn!("redis does not let floodgate use FCALL; deciding with EVALSHA instead");
        }
        self.script.load(conn)?;
        Ok(Shipping::Script)
    }
}

/// `FUNCTION LOAD REPLACE` of `library`: a library of the same name is the
/// same source (the name carries its SHA1), so replacing one that another
/// process loaded meanwhile changes nothing.
pub(crate) fn load_library_cmd(library: &str) -> redis::Cmd {
    let mut load = redis::cmd("FUNCTION");
    load.arg("LOAD").arg("REPLACE").arg(library);
    load
}

/// Loads `library` on `conn` (see [`load_library_cmd`]).
pub(crate) fn load_library<C: redis::ConnectionLike>(
    conn: &mut C,
    library: &str,
) -> Result<(), RedisError> {
    load_library_cmd(library).query::<String>(conn).map(drop)
}

/// What an error Redis answered to a batch call says is missing, if
/// anything: then the call ran nothing.
pub(crate) fn missing(e: &RedisError) -> Option<Missing> {
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::NoScript) => Some(Missing::Script),
        ErrorKind::Server(ServerErrorKind::ResponseError)
            if e.detail()
                .is_some_and(|d| d.starts_with("Function not found")) =>
        {
            Some(Missing::Function)
        }
        _ if refuses_functions(e) => Some(Missing::Functions),
        _ => None,
    }
}

/// Whether `e` says that Redis refuses functions: a command it does not
/// know (Redis 6 has neither `FCALL` nor `FUNCTION`), or one the
/// connection's user may not run. Nothing ran.
pub(crate) fn refuses_functions(e: &RedisError) -> bool {
    let detail = e.detail().unwrap_or_default();
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::NoPerm) => {
            detail.contains("'fcall") || detail.contains("'function")
        }
        ErrorKind::Server(ServerErrorKind::ResponseError) => {
            detail.starts_with("unknown command") || detail.starts_with("unknown subcommand")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_runs_the_script_once_and_calls_its_batch() {
        let p = Program::batch();
        assert!(SCRIPT_SOURCE.trim_end().ends_with("return batch()"));
        assert!(p.library.starts_with("#!lua name=floodgate_"));
        // The script's own last line is gone: `init` returns the function.
        assert!(p.library.contains("\nreturn batch\nend\n"));
        assert!(!p.library.contains("return batch()\n\nreturn batch\n"));
        assert!(!p.library.contains("return batch()\nreturn batch\n"));
        assert_eq!(p.target(Shipping::Function).0, "FCALL");
        assert_eq!(p.target(Shipping::Script), ("EVALSHA", p.script.get_hash()));
        assert!(p.function.ends_with(&p.script.get_hash()[..16]));
    }
}
