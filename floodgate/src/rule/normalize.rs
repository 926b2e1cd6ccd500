//! Phone numbers in E.164, read with a region's dialling conventions (the
//! `e164` feature).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

use phonenumber::metadata::{Descriptor, Metadata, DATABASE};
use regex::{Regex, RegexBuilder};

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

/// A phone number in E.164, `+DIGITS`, or `None` when the value is no
/// possible number. Only digits, one leading `+`, spaces and `-./()[]` are
/// accepted.
///
/// The number is read as libphonenumber reads it, with the metadata of the
/// country it belongs to:
/// - a leading `+` gives the country code, whatever `region` is;
/// - otherwise `region`'s international prefix (011 in the US, 00 in most
///   of Europe, 810 in Russia) announces a country code, and without one
///   the number is `region`'s own;
/// - that country's national prefix (and carrier code, where its rules have
///   one) is taken off only when its rules say so and the rest is still a
///   possible number of the country; a number that is valid as written is
///   never shortened (`+7 800 555 35 35` keeps its 8, `+49 151 12345678`
///   its 1);
/// - the result must be a possible number of the country: it matches the
///   country's number pattern with a length its numbers have.
///
/// So `+1 555 010 7777`, `1-555-010-7777` and `011 1 555 010 7777` are one
/// number, `001 555 010 7777` (no US prefix) is none, and `+49 160 1234567`
/// and `+49 60 1234567` stay two numbers.
///
/// The site reads its phone fields with this same function, so its
/// accounts and the rules agree on what one number is.
pub fn e164(value: &str, region: Region) -> Option<String> {
    let t = value.trim();
    if t.is_empty() || t.len() > MAX_PHONE_CHARS {
        return None;
    }
    let (plus, body) = match t.strip_prefix('+') {
        Some(rest) => (true, rest),
        None => (false, t),
    };
    if !body
        .chars()
        .all(|c| c.is_ascii_digit() || " -./()[]".contains(c))
    {
        return None;
    }
    let digits: String = body.chars().filter(char::is_ascii_digit).collect();
    if digits.is_empty() {
        return None;
    }
    let home = DATABASE.by_id(region.code())?;
    let (code, national, rules) = if plus {
        let (code, rest) = country_code(&digits)?;
        (code, rest.to_string(), main_region(code)?)
    } else if let Some(rest) = after_international_prefix(home, &digits) {
        let (code, rest) = country_code(rest)?;
        (code, rest.to_string(), main_region(code)?)
    } else {
        let code = home.country_code();
        (code, home_national(home, &digits), home)
    };
    let national = without_national_prefix(rules, code, national);
    if !possible(code, &national) {
        return None;
    }
    let e164 = format!("+{code}{national}");
    // E.164 allows at most 15 digits.
    (e164.len() <= 16).then_some(e164)
}

/// Calling codes are 1 to 3 digits and none is the start of another.
fn country_code(digits: &str) -> Option<(u16, &str)> {
    if digits.starts_with('0') {
        return None;
    }
    (1..=3).find_map(|len| {
        let (head, rest) = (digits.get(..len)?, digits.get(len..)?);
        let code: u16 = head.parse().ok()?;
        DATABASE.by_code(&code).map(|_| (code, rest))
    })
}

/// The metadata whose rules apply to numbers written with this calling
/// code (`US` for +1, `GB` for +44, `RU` for +7).
fn main_region(code: u16) -> Option<&'static Metadata> {
    let regions = DATABASE.by_code(&code)?;
    regions
        .iter()
        .find(|m| m.is_main_country_for_code())
        .or_else(|| regions.first())
        .copied()
}

/// The digits after `home`'s international prefix, when they start with it
/// (and do not go on with a 0: no calling code starts with one).
fn after_international_prefix<'a>(home: &Metadata, digits: &'a str) -> Option<&'a str> {
    let idd = home.international_prefix()?;
    let end = anchored(idd.as_str(), Anchor::Start)?.find(digits)?.end();
    let rest = digits.get(end..)?;
    (end > 0 && !rest.starts_with('0')).then_some(rest)
}

/// A number written without `+` or international prefix: `home`'s own.
/// As libphonenumber does, it may start with `home`'s calling code: that
/// is taken off when the digits are no number of `home` with it and are
/// one without it, or are too long to be one.
fn home_national(home: &'static Metadata, digits: &str) -> String {
    let code = home.country_code();
    if let Some(rest) = digits.strip_prefix(code.to_string().as_str()) {
        let shorter = without_national_prefix(home, code, rest.to_string());
        let general = home.descriptors().general();
        let too_long = lengths(home).max().is_some_and(|max| digits.len() > max);
        if too_long || (!full_match(general, digits) && full_match(general, &shorter)) {
            return shorter;
        }
    }
    digits.to_string()
}

/// `national` without the national prefix (and carrier code) that the
/// rules of `meta` recognise, when taking it off is right: the number is
/// not valid as written, it stays a number of the country's pattern, and
/// what is left has a possible length.
fn without_national_prefix(meta: &'static Metadata, code: u16, national: String) -> String {
    let pattern = match (meta.national_prefix_for_parsing(), meta.national_prefix()) {
        (Some(re), _) => re.as_str().to_string(),
        (None, Some(prefix)) if !prefix.is_empty() => regex::escape(prefix),
        _ => return national,
    };
    let Some(re) = anchored(&pattern, Anchor::Start) else {
        return national;
    };
    let Some(caps) = re.captures(&national) else {
        return national;
    };
    let Some(whole) = caps.get(0) else {
        return national;
    };
    if whole.end() == 0 || valid(code, &national) {
        return national;
    }
    let rest = &national[whole.end()..];
    let groups = caps.len() - 1;
    let stripped = match meta.national_prefix_transform_rule() {
        Some(rule) if groups > 0 && caps.get(groups).is_some() => {
            let mut out = String::new();
            caps.expand(&dollar_groups(rule), &mut out);
            out.push_str(rest);
            out
        }
        _ => rest.to_string(),
    };
    let general = meta.descriptors().general();
    if full_match(general, &national) && !full_match(general, &stripped) {
        return national;
    }
    if !lengths(meta).any(|len| len == stripped.len()) {
        return national;
    }
    stripped
}

/// A transform rule's `$1` as the regex crate's `${1}`, so that a digit
/// after it is not read as part of the group number.
fn dollar_groups(rule: &str) -> String {
    let mut out = String::new();
    let mut chars = rule.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('$', Some(d)) if d.is_ascii_digit() => {
                out.push_str(&format!("${{{d}}}"));
                chars.next();
            }
            _ => out.push(c),
        }
    }
    out
}

/// The number types a number can have (short codes and emergency numbers
/// are none of them).
fn types(meta: &Metadata) -> impl Iterator<Item = &Descriptor> {
    let d = meta.descriptors();
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
}

/// The national lengths of a region's numbers (of any type; numbers that
/// can be dialled only locally excluded).
fn lengths(meta: &Metadata) -> impl Iterator<Item = usize> + '_ {
    meta.descriptors()
        .general()
        .possible_length()
        .iter()
        .chain(types(meta).flat_map(|d| d.possible_length()))
        .map(|&len| usize::from(len))
}

/// Whether `national` is a possible number of calling code `code`: the
/// general pattern of one of its regions matches all of it, with a length
/// that region's numbers have.
fn possible(code: u16, national: &str) -> bool {
    DATABASE.by_code(&code).is_some_and(|regions| {
        regions.iter().any(|meta| {
            full_match(meta.descriptors().general(), national)
                && lengths(meta).any(|len| len == national.len())
        })
    })
}

/// Whether `national` is a valid number of calling code `code`: a number
/// type of one of its regions matches all of it, with that type's length.
fn valid(code: u16, national: &str) -> bool {
    DATABASE.by_code(&code).is_some_and(|regions| {
        regions.iter().any(|meta| {
            types(meta).any(|desc| {
                let lengths = desc.possible_length();
                (lengths.is_empty() || lengths.iter().any(|&l| usize::from(l) == national.len()))
                    && full_match(desc, national)
            })
        })
    })
}

/// Whether a descriptor's pattern matches the whole of `national`.
fn full_match(desc: &Descriptor, national: &str) -> bool {
    anchored(desc.national_number().as_str(), Anchor::Both).is_some_and(|re| re.is_match(national))
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Anchor {
    /// At the start of the text (libphonenumber's "looking at").
    Start,
    /// The whole text.
    Both,
}

type Compiled = HashMap<(&'static str, Anchor), Option<Arc<Regex>>>;

/// A metadata pattern compiled once, anchored; `None` if it does not
/// compile (then it matches nothing). The patterns are the metadata's own
/// (a fixed set), so the cache is bounded.
fn anchored(pattern: &str, anchor: Anchor) -> Option<Arc<Regex>> {
    static CACHE: OnceLock<RwLock<Compiled>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| RwLock::new(HashMap::new()));
    let key = (pattern, anchor);
    if let Some(hit) = cache.read().ok()?.get(&key) {
        return hit.clone();
    }
    let source = match anchor {
        Anchor::Start => format!("^(?:{pattern})"),
        Anchor::Both => format!("^(?:{pattern})$"),
    };
    let compiled = RegexBuilder::new(&source)
        .ignore_whitespace(true)
        .build()
        .ok()
        .map(Arc::new);
    // Keys borrow from the metadata, which lives as long as the program;
    // the escaped national prefixes (not borrowed from it) are leaked once
    // each, and there are only as many as regions.
    let stored: &'static str = Box::leak(pattern.to_string().into_boxed_str());
    if let Ok(mut map) = cache.write() {
        map.entry((stored, anchor))
            .or_insert_with(|| compiled.clone());
    }
    compiled
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(code: &str) -> Region {
        Region::parse(code).unwrap()
    }

    /// Numbers of many countries, as people write them (with `+`, with
    /// the region's national or international prefix, with a carrier
    /// code), and the one E.164 number each is. Most are libphonenumber's
    /// own example numbers.
    const TABLE: &[(&str, &str, &str)] = &[
        // Germany: mobile and landline, with + and nationally.
        ("+49 151 12345678", "US", "+4915112345678"),
        ("+49 160 1234567", "US", "+491601234567"),
        ("+49 60 1234567", "US", "+49601234567"),
        ("+49 30 123456", "US", "+4930123456"),
        ("+49 (0)30 123456", "GB", "+4930123456"),
        ("030 123456", "DE", "+4930123456"),
        ("0151 12345678", "DE", "+4915112345678"),
        ("00 49 151 12345678", "DE", "+4915112345678"),
        ("011 49 151 12345678", "US", "+4915112345678"),
        // France.
        ("+33 1 23 45 67 89", "US", "+33123456789"),
        ("01 23 45 67 89", "FR", "+33123456789"),
        ("+33 6 12 34 56 78", "DE", "+33612345678"),
        // United Kingdom.
        ("+44 7400 123456", "US", "+447400123456"),
        ("07400 123456", "GB", "+447400123456"),
        ("+44 20 7946 0000", "US", "+442079460000"),
        // Brazil: the area code stays; a carrier code is dropped.
        ("+55 11 91234 5678", "US", "+5511912345678"),
        ("(11) 91234-5678", "BR", "+5511912345678"),
        ("0 21 11 91234 5678", "BR", "+5511912345678"),
        ("+55 11 2345 6789", "US", "+551123456789"),
        // China.
        ("+86 131 2345 6789", "US", "+8613123456789"),
        ("+86 10 1234 5678", "US", "+861012345678"),
        ("010 1234 5678", "CN", "+861012345678"),
        // South Korea.
        ("+82 10 2000 0000", "US", "+821020000000"),
        ("010-2000-0000", "KR", "+821020000000"),
        ("+82 2 212 3456", "US", "+8222123456"),
        // Egypt.
        ("+20 100 123 4567", "US", "+201001234567"),
        ("+20 2 3456 7890", "US", "+20234567890"),
        ("0100 123 4567", "EG", "+201001234567"),
        // Australia.
        ("+61 4 1234 5678", "US", "+61412345678"),
        ("0412 345 678", "AU", "+61412345678"),
        ("+61 2 1234 5678", "US", "+61212345678"),
        // Japan.
        ("+81 90 1234 5678", "US", "+819012345678"),
        ("090-1234-5678", "JP", "+819012345678"),
        ("+81 3 1234 5678", "US", "+81312345678"),
        // India.
        ("+91 81234 56789", "US", "+918123456789"),
        ("081234 56789", "IN", "+918123456789"),
        // The United States and Canada.
        ("+1 201 555 0123", "DE", "+12015550123"),
        ("(201) 555-0123", "US", "+12015550123"),
        ("1 201 555 0123", "US", "+12015550123"),
        ("+1 506 234 5678", "US", "+15062345678"),
        ("(506) 234-5678", "CA", "+15062345678"),
        // Italy keeps the leading zero of landlines.
        ("+39 02 1234 5678", "US", "+390212345678"),
        ("02 1234 5678", "IT", "+390212345678"),
        ("+39 312 345 6789", "US", "+393123456789"),
        // Spain, Mexico, Nigeria.
        ("+34 612 34 56 78", "US", "+34612345678"),
        ("+52 222 123 4567", "US", "+522221234567"),
        ("+234 802 123 4567", "US", "+2348021234567"),
        ("0802 123 4567", "NG", "+2348021234567"),
        // Russia: 8 is the national prefix, and also starts 800 numbers.
        ("+7 912 345 67 89", "US", "+79123456789"),
        ("8 912 345 67 89", "RU", "+79123456789"),
        ("+7 800 555 35 35", "US", "+78005553535"),
        ("8 800 555 35 35", "RU", "+78005553535"),
        ("810 49 151 12345678", "RU", "+4915112345678"),
        // Kazakhstan shares +7.
        ("+7 771 000 9998", "US", "+77710009998"),
        // Argentina: mobiles dialled nationally with 15 get their 9.
        ("+54 9 11 2345 6789", "US", "+5491123456789"),
        ("011 15 2345-6789", "AR", "+5491123456789"),
        // South Africa, Sweden, the Netherlands, Switzerland, Turkey.
        ("+27 71 123 4567", "US", "+27711234567"),
        ("+46 70 123 45 67", "US", "+46701234567"),
        ("070-123 45 67", "SE", "+46701234567"),
        ("+31 6 12345678", "US", "+31612345678"),
        ("+41 78 123 45 67", "US", "+41781234567"),
        ("+90 501 234 56 78", "US", "+905012345678"),
    ];

    #[test]
    fn numbers_of_every_country_are_kept_exactly() {
        for (text, region, want) in TABLE {
            assert_eq!(
                e164(text, r(region)).as_deref(),
                Some(*want),
                "{text} read in {region}"
            );
        }
    }

    #[test]
    fn different_subscribers_stay_different() {
        for (a, b) in [
            ("+49 160 1234567", "+49 60 1234567"),
            ("+49 151 12345678", "+49 51 12345678"),
            ("+55 11 91234 5678", "+55 1 91234 5678"),
            ("+86 131 2345 6789", "+86 31 2345 6789"),
            ("+61 4 1234 5678", "+61 1234 5678"),
            ("+81 90 1234 5678", "+81 9 0123 4567"),
            ("+7 800 555 35 35", "+7 00 555 35 35"),
        ] {
            let (x, y) = (e164(a, Region::us()), e164(b, Region::us()));
            assert!(x.is_some(), "{a}");
            assert_ne!(x, y, "{a} and {b} are two numbers");
        }
    }

    #[test]
    fn impossible_numbers_are_none() {
        for (text, region) in [
            ("+33 1 23 45 67", "US"),
            ("+33 1 23 45 67 89 0", "US"),
            ("+44 20 7946 000", "US"),
            ("+1 055 010 7777", "US"),
            ("+999 123 456 789", "US"),
            ("+0 123 456 789", "US"),
            ("+49 0", "US"),
            ("+7 00 555 35 35", "US"),
            ("0 0", "DE"),
        ] {
            assert_eq!(e164(text, r(region)), None, "{text} in {region}");
        }
    }

    /// Every example number of the metadata, of every region and type,
    /// written with `+` and its country code, and written as its own
    /// region writes it, is itself.
    #[test]
    fn every_example_number_reads_back_as_itself() {
        let mut checked = 0;
        for meta in DATABASE.iter() {
            let code = meta.country_code();
            for desc in super::types(meta) {
                let Some(example) = desc.example() else {
                    continue;
                };
                let want = format!("+{code}{example}");
                if want.len() > 16 {
                    continue;
                }
                assert_eq!(
                    e164(&format!("+{code} {example}"), Region::us()).as_deref(),
                    Some(want.as_str()),
                    "{} example {example}",
                    meta.id()
                );
                if let Some(region) = Region::parse(meta.id()) {
                    assert_eq!(
                        e164(example, region).as_deref(),
                        Some(want.as_str()),
                        "{} example {example} written nationally",
                        meta.id()
                    );
                }
                checked += 1;
            }
        }
        assert!(checked > 1000, "{checked} examples");
    }
}
