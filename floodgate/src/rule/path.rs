//! Beego-style path patterns: `/exact`, `/prefix/*`, `/user/:id`.
//!
//! Patterns are matched against the percent-decoded request path, segment
//! by segment. A trailing slash is not significant (`/check/` is guarded
//! by `/check`), so a client cannot step around a rule by adding one.

/// One segment of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// Must equal this text.
    Literal(String),
    /// `:name`: any one non-empty segment.
    Param,
}

/// A compiled path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    segments: Vec<Segment>,
    /// Ends in `/*`: any further segments (or none) match.
    prefix: bool,
}

impl PathPattern {
    /// Compiles a pattern; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<PathPattern, String> {
        if !text.starts_with('/') {
            return Err(format!("path {text:?} must start with \"/\""));
        }
        let mut segments = Vec::new();
        let mut prefix = false;
        let parts: Vec<&str> = text[1..].split('/').collect();
        for (i, part) in parts.iter().enumerate() {
            let last = i + 1 == parts.len();
            if *part == "*" {
                if !last {
                    return Err(format!("path {text:?}: \"*\" may only be the last segment"));
                }
                prefix = true;
            } else if let Some(name) = part.strip_prefix(':') {
                if name.is_empty() {
                    return Err(format!("path {text:?}: \":\" must be followed by a name"));
                }
                segments.push(Segment::Param);
            } else if part.contains('*') {
                return Err(format!("path {text:?}: \"*\" must be a whole segment"));
            } else if part.is_empty() {
                if !last {
                    return Err(format!("path {text:?} has an empty segment"));
                }
            } else {
                segments.push(Segment::Literal((*part).to_string()));
            }
        }
        Ok(PathPattern { segments, prefix })
    }

    /// Whether `path` (decoded, starting with `/`) matches.
    pub fn matches(&self, path: &str) -> bool {
        let trimmed = path.strip_prefix('/').unwrap_or(path);
        let trimmed = trimmed.strip_suffix('/').unwrap_or(trimmed);
        // The path's segments, read as they are compared (no list is made:
        // this runs for every rule on every request).
        let mut parts = (!trimmed.is_empty())
            .then(|| trimmed.split('/'))
            .into_iter()
            .flatten();
        for segment in &self.segments {
            let Some(p) = parts.next() else {
                return false;
            };
            let fits = match segment {
                Segment::Literal(l) => l == p,
                Segment::Param => !p.is_empty(),
            };
            if !fits {
                return false;
            }
        }
        self.prefix || parts.next().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::PathPattern;

    fn m(pattern: &str, path: &str) -> bool {
        PathPattern::parse(pattern).unwrap().matches(path)
    }

    #[test]
    fn exact() {
        assert!(m("/check", "/check"));
        assert!(m("/check", "/check/"));
        assert!(!m("/check", "/checks"));
        assert!(!m("/check", "/check/x"));
        assert!(m("/", "/"));
        assert!(!m("/", "/x"));
    }

    #[test]
    fn prefix() {
        assert!(m("/api/*", "/api/ping"));
        assert!(m("/api/*", "/api/a/b"));
        assert!(m("/api/*", "/api"));
        assert!(!m("/api/*", "/apix"));
        assert!(m("/*", "/anything/at/all"));
    }

    #[test]
    fn params() {
        assert!(m("/user/:id", "/user/42"));
        assert!(!m("/user/:id", "/user"));
        assert!(!m("/user/:id", "/user/42/x"));
        assert!(m("/user/:id/*", "/user/42/x/y"));
    }

    #[test]
    fn bad_patterns() {
        assert!(PathPattern::parse("check").is_err());
        assert!(PathPattern::parse("/a/*/b").is_err());
        assert!(PathPattern::parse("/a/:").is_err());
        assert!(PathPattern::parse("/a//b").is_err());
        assert!(PathPattern::parse("/a*").is_err());
    }
}
