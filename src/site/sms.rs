//! Sending SMS: a small trait and the two demo providers. No real gateway.

use redis::Commands;
use serde::{Deserialize, Serialize};

use floodgate::limiter::RedisConn;

use super::phone::Phone;

/// One message "sent".
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Message {
    /// Recipient, `+DIGITS`.
    pub phone: String,
    /// The text.
    pub text: String,
    /// When, RFC 3339 UTC.
    pub sent_at: String,
}

/// Messages kept in the outbox.
const OUTBOX_LEN: isize = 100;
/// How long the outbox keeps messages.
const OUTBOX_TTL_SECS: i64 = 3600;

/// Something that delivers a text to a phone. Blocking: call it from
/// `web::block`.
pub trait SmsSender: Send + Sync {
    /// Delivers `text` to `phone`.
    fn send(&self, conn: &mut RedisConn, phone: &Phone, text: &str) -> redis::RedisResult<()>;
}

/// Keeps messages in a Redis list (newest first, TTL), shown at `/dev/outbox`.
pub struct Outbox {
    /// The list's key.
    pub key: String,
}

impl SmsSender for Outbox {
    fn send(&self, conn: &mut RedisConn, phone: &Phone, text: &str) -> redis::RedisResult<()> {
        let message = Message {
            phone: phone.display(),
            text: text.to_string(),
            sent_at: now_rfc3339(),
        };
        let json = serde_json::to_string(&message).unwrap_or_default();
        redis::pipe()
            .atomic()
            .lpush(&self.key, json)
            .ltrim(&self.key, 0, OUTBOX_LEN - 1)
            .expire(&self.key, OUTBOX_TTL_SECS)
            .exec(conn)
    }
}

impl Outbox {
    /// The messages, newest first.
    pub fn read(&self, conn: &mut RedisConn) -> redis::RedisResult<Vec<Message>> {
        let items: Vec<String> = conn.lrange(&self.key, 0, OUTBOX_LEN - 1)?;
        Ok(items
            .iter()
            .filter_map(|s| serde_json::from_str(s).ok())
            .collect())
    }
}

/// Writes messages to the process log: a development delivery channel.
/// The log is then where codes arrive, as a phone would receive them.
pub struct LogSender;

impl SmsSender for LogSender {
    fn send(&self, _: &mut RedisConn, phone: &Phone, text: &str) -> redis::RedisResult<()> {
        log::info!(target: "floodgate::sms", "SMS to {}: {text}", phone.display());
        Ok(())
    }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    rfc3339(secs)
}

fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn dates() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339(1_795_960_000), "2026-11-29T13:46:40Z");
        assert_eq!(super::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }
}
