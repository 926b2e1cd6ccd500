//! Key values as the rules compare them: digits, lower case, or a phone
//! number in E.164 read with a region's dialling conventions.

use phonenumber::metadata::DATABASE;

use super::Normalize;

/// Applies a rule's `normalize` to a header, query or form value; `None`
/// when nothing is left (the request is then keyed by its address).
pub fn normalize(value: &str, how: Normalize) -> Option<String> {
    let v = match how {
        Normalize::None => value.to_string(),
        Normalize::Digits => value.chars().filter(char::is_ascii_digit).collect(),
        Normalize::Lowercase => value.trim().to_lowercase(),
        Normalize::E164(region) => return e164(value, region),
    };
    (!v.is_empty()).then_some(v)
}

/// A region whose dialling conventions apply to numbers written without a
/// leading `+` (its national prefix, its international prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region(pub(super) phonenumber::country::Id);

impl Region {
    /// A two-letter region code with phone number data (`US`, `GB`, `de`…).
    pub fn parse(code: &str) -> Option<Region> {
        let id: phonenumber::country::Id = code.trim().to_ascii_uppercase().parse().ok()?;
        DATABASE.by_id(id.as_ref())?;
        Some(Region(id))
    }

    /// The United States (the default).
    pub fn us() -> Region {
        Region(phonenumber::country::US)
    }

    /// The two-letter code.
    pub fn code(&self) -> &str {
        self.0.as_ref()
    }
}

impl Default for Region {
    fn default() -> Region {
        Region::us()
    }
}

/// Longest phone value parsed (anything longer is not a phone number).
const MAX_PHONE_CHARS: usize = 64;

/// A phone number in E.164, `+DIGITS`: a leading `+` gives the country
/// code; otherwise `region`'s international prefix (011 in the US, 00 in
/// most of Europe) or national prefix (1 in the US, 0 in the UK) is
/// recognised and removed as libphonenumber does. Only digits, one leading
/// `+`, spaces and `-./()[]` are accepted. `None` unless the result is a
/// possible number (the national part has a length the country uses), so
/// that `+1 555 010 7777`, `1-555-010-7777` and `011 1 555 010 7777` are
/// one number, and `001 555 010 7777` (no US prefix) is none.
///
/// The site reads its phone fields with this same function, so its
/// accounts and the rules agree on what one number is.
pub fn e164(value: &str, region: Region) -> Option<String> {
    let t = value.trim();
    if t.is_empty() || t.len() > MAX_PHONE_CHARS {
        return None;
    }
    let body = t.strip_prefix('+').unwrap_or(t);
    if !body
        .chars()
        .all(|c| c.is_ascii_digit() || " -./()[]".contains(c))
    {
        return None;
    }
    if !body.chars().any(|c| c.is_ascii_digit()) {
        return None;
    }
    // The parser is third-party code fed with client input: a panic in it
    // must cost this request its key, never the worker.
    let parsed = std::panic::catch_unwind(|| phonenumber::parse(Some(region.0), t)).ok()?;
    let number = parsed.ok()?;
    let code = number.code().value();
    let national = number.national().to_string();
    let len = u16::try_from(national.len()).ok()?;
    if !possible_length(code, len) {
        return None;
    }
    let e164 = format!("+{code}{national}");
    // E.164 allows at most 15 digits.
    (e164.len() <= 16).then_some(e164)
}

/// Whether national numbers of country `code` have `len` digits: the
/// lengths of any number type of the country's main region (what
/// libphonenumber's "possible number" means), local-only lengths excluded.
fn possible_length(code: u16, len: u16) -> bool {
    let Some(meta) = DATABASE.by_code(&code).and_then(|m| m.into_iter().next()) else {
        return false;
    };
    let d = meta.descriptors();
    if d.general().possible_length().contains(&len) {
        return true;
    }
    [
        d.fixed_line(),
        d.mobile(),
        d.toll_free(),
        d.premium_rate(),
        d.shared_cost(),
        d.personal_number(),
        d.voip(),
        d.pager(),
        d.uan(),
        d.voicemail(),
    ]
    .into_iter()
    .flatten()
    .any(|desc| desc.possible_length().contains(&len))
}
