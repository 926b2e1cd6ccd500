//! Phone numbers as users type them.

/// Why a phone number was refused (shown next to the field).
pub const PHONE_RULE: &str =
    "Enter a phone number of 8 to 15 digits, optionally starting with +; spaces, dashes, dots and brackets are fine.";

/// A checked phone number: its digits (the account key, and what the
/// `digits` normalization of a rule yields for any way of writing it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Phone(String);

impl Phone {
    /// Accepts 8 to 15 digits with an optional leading `+`; spaces, dashes,
    /// dots and brackets are ignored; anything else is refused.
    pub fn parse(text: &str) -> Option<Phone> {
        let t = text.trim();
        let t = t.strip_prefix('+').unwrap_or(t);
        let mut digits = String::with_capacity(15);
        for c in t.chars() {
            match c {
                '0'..='9' => digits.push(c),
                ' ' | '-' | '.' | '(' | ')' | '[' | ']' => {}
                _ => return None,
            }
        }
        (8..=15).contains(&digits.len()).then_some(Phone(digits))
    }

    /// The digits.
    pub fn digits(&self) -> &str {
        &self.0
    }

    /// `+DIGITS`, for display.
    pub fn display(&self) -> String {
        format!("+{}", self.0)
    }

    /// `+1555•••99`: enough to recognize, for logs and notices.
    pub fn masked(&self) -> String {
        let d = &self.0;
        let tail = &d[d.len() - 2..];
        let head = &d[..4];
        format!("+{head}•••{tail}")
    }
}

#[cfg(test)]
mod tests {
    use super::Phone;

    #[test]
    fn formats_are_one_number() {
        let a = Phone::parse("+1 (555) 010-9999").unwrap();
        let b = Phone::parse("15550109999").unwrap();
        let c = Phone::parse("1.555.010.9999").unwrap();
        assert_eq!(a, b);
        assert_eq!(b, c);
        assert_eq!(a.display(), "+15550109999");
        assert_eq!(a.masked(), "+1555•••99");
    }

    #[test]
    fn refuses_the_rest() {
        for bad in [
            "",
            "1234567",
            "1234567890123456",
            "555-CALL-NOW",
            "++15550109999",
            "1555 0109 999x",
        ] {
            assert!(Phone::parse(bad).is_none(), "{bad}");
        }
    }
}
