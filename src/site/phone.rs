//! Phone numbers as users type them.

use floodgate::rule::{self as key, Region};

/// Why a phone number was refused (shown next to the field).
pub const PHONE_RULE: &str =
    "Enter a phone number of 8 to 15 digits, optionally starting with +; spaces, dashes, dots and brackets are fine. Without +, it is read as a number of the site's region.";

/// A checked phone number in E.164 (`+DIGITS`): the account key, and what
/// the `e164` normalization of a rule yields for any way of writing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Phone(String);

impl Phone {
    /// Accepts 8 to 15 digits with an optional leading `+`; spaces, dashes,
    /// dots and brackets are ignored; anything else is refused. The number
    /// is then read by the same function as the rules' `e164` normalizer
    /// (with `region` for numbers written without `+`), and refused when it
    /// is not a possible number.
    pub fn parse(text: &str, region: Region) -> Option<Phone> {
        let t = text.trim();
        let rest = t.strip_prefix('+').unwrap_or(t);
        let mut digits = 0;
        for c in rest.chars() {
            match c {
                '0'..='9' => digits += 1,
                ' ' | '-' | '.' | '(' | ')' | '[' | ']' => {}
                _ => return None,
            }
        }
        if !(8..=15).contains(&digits) {
            return None;
        }
        key::e164(t, region).map(Phone)
    }

    /// A number already in E.164, as stored in a session (`+DIGITS`).
    pub fn stored(e164: &str) -> Option<Phone> {
        let digits = e164.strip_prefix('+')?;
        (!digits.is_empty() && digits.len() <= 15 && digits.bytes().all(|b| b.is_ascii_digit()))
            .then(|| Phone(e164.to_string()))
    }

    /// `+DIGITS`.
    pub fn e164(&self) -> &str {
        &self.0
    }

    /// `+DIGITS`, for display.
    pub fn display(&self) -> String {
        self.0.clone()
    }

    /// `+1555•••99`: enough to recognize, for logs and notices.
    pub fn masked(&self) -> String {
        let d = &self.0;
        let tail = &d[d.len() - 2..];
        let head = &d[..d.len().min(5)];
        format!("{head}•••{tail}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(text: &str) -> Option<Phone> {
        Phone::parse(text, Region::us())
    }

    #[test]
    fn formats_are_one_number() {
        let a = us("+1 (555) 010-9999").unwrap();
        let b = us("15550109999").unwrap();
        let c = us("1.555.010.9999").unwrap();
        let d = us("(555) 010-9999").unwrap();
        let e = us("011 1 555 010 9999").unwrap();
        assert_eq!(a, b);
        assert_eq!(b, c);
        assert_eq!(c, d);
        assert_eq!(d, e);
        assert_eq!(a.display(), "+15550109999");
        assert_eq!(a.masked(), "+1555•••99");
        // The site and the rules read a number with the same function.
        assert_eq!(
            key::e164("1-555-010-9999", Region::us()).as_deref(),
            Some(a.e164())
        );
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
            // Possible lengths only: these are no number in the US.
            "001 555 010 7777",
            "0001 555 010 7777",
            "00001 555 010 7777",
            "12345678",
        ] {
            assert!(us(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn stored_numbers_read_back() {
        assert_eq!(Phone::stored("+15550109999"), us("+1 555 010 9999"));
        assert_eq!(Phone::stored("15550109999"), None);
        assert_eq!(Phone::stored("+1x"), None);
    }
}
