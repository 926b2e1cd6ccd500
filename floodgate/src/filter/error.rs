//! Why a filter could not be built.

use crate::config::ConfigError;
use crate::limiter::LimiterError;

/// Why a filter could not be built.
#[derive(Debug)]
#[non_exhaustive]
pub enum SetupError {
    /// The configuration is unusable; `Display` is `FILE: WHERE: WHAT`.
    Config(ConfigError),
    /// The Redis client or the dispatcher threads could not be set up.
    Limiter(LimiterError),
    /// A limit declared in code cannot be used (a limit of 0, say).
    Limit(String),
    /// A setting made in code is out of the range the file allows (a
    /// `max_form` of 0, say).
    Setting(String),
}

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SetupError::Config(e) => write!(f, "{e}"),
            SetupError::Limiter(e) => write!(f, "cannot set up the limiter: {e}"),
            SetupError::Limit(e) => write!(f, "unusable limit {e}"),
            SetupError::Setting(e) => write!(f, "unusable setting {e}"),
        }
    }
}

impl std::error::Error for SetupError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SetupError::Config(e) => Some(e),
            SetupError::Limiter(e) => Some(e),
            SetupError::Limit(_) | SetupError::Setting(_) => None,
        }
    }
}

impl From<ConfigError> for SetupError {
    fn from(e: ConfigError) -> SetupError {
        SetupError::Config(e)
    }
}

impl From<LimiterError> for SetupError {
    fn from(e: LimiterError) -> SetupError {
        SetupError::Limiter(e)
    }
}
