//! Which hash slot a key is in. redis-rs does not export its own slot
//! function, so this is the CRC16 of the Redis Cluster specification,
//! checked against what `CLUSTER KEYSLOT` answers.

use redis::Value;

/// Number of hash slots in a Redis Cluster.
pub(crate) const SLOTS: u16 = 16384;

/// `CLUSTER SLOTS` as (first slot, last slot, master host, master port);
/// `None` if the reply is not shaped like one. Ranges whose master has no
/// known address (an empty host) are left out.
pub(crate) fn parse_slots(value: &Value) -> Option<Vec<(u16, u16, String, u16)>> {
    let Value::Array(ranges) = value else {
        return None;
    };
    let mut out = Vec::with_capacity(ranges.len());
    for range in ranges {
        let Value::Array(fields) = range else {
            return None;
        };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
            (fields.first(), fields.get(1), fields.get(2))
        else {
            return None;
        };
        let host = match master.first() {
            Some(Value::BulkString(b)) => String::from_utf8(b.clone()).ok()?,
            Some(Value::SimpleString(s)) => s.clone(),
            _ => return None,
        };
        let Some(Value::Int(port)) = master.get(1) else {
            return None;
        };
        let (Ok(start), Ok(end), Ok(port)) = (
            u16::try_from(*start),
            u16::try_from(*end),
            u16::try_from(*port),
        ) else {
            return None;
        };
        if !host.is_empty() && host != "?" {
            out.push((start, end, host, port));
        }
    }
    Some(out)
}

/// The cluster hash slot of a key: CRC16 (XMODEM) of the key, or of its
/// hash tag (the part between the first `{` and the next `}`, when not
/// empty), modulo 16384.
pub(crate) fn key_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16(hashed) % SLOTS
}

/// A key in `slot` that nothing ever writes: a per-master call touches it
/// first, to learn whether the slot is served where the call landed and is
/// not being moved (see `lua/batch.lua`).
pub(crate) fn probe_key(slot: u16) -> &'static str {
    static PROBES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let probes = PROBES.get_or_init(|| {
        let mut probes = vec![String::new(); usize::from(SLOTS)];
        let mut left = probes.len();
        let mut n: u32 = 0;
        while left > 0 {
            let tag = n.to_string();
            let at = usize::from(crc16(tag.as_bytes()) % SLOTS);
            if probes[at].is_empty() {
                probes[at] = format!("floodgate:slot:{{{tag}}}");
                left -= 1;
            }
            n += 1;
        }
        probes
    });
    probes.get(usize::from(slot)).map_or("", String::as_str)
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis_cluster() {
        // Values from the Redis Cluster specification and CLUSTER KEYSLOT.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"{user1000}.followers"), key_slot(b"user1000"));
        // An empty tag hashes the whole key; only the first tag counts.
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
    }

    #[test]
    fn every_slot_has_a_probe_key_of_its_own() {
        for slot in 0..SLOTS {
            assert_eq!(key_slot(probe_key(slot).as_bytes()), slot);
        }
    }
}
