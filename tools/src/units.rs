//! Sizes and durations as people type and read them: `64`, `4K`, `1M`, `64M`; `25.3 µs`.

use std::time::Duration;

/// The largest size a benchmark accepts: the default `Limits` allow payloads up to 1 GiB, and
/// each side holds a few buffers of this size.
pub const MAX_SIZE: u64 = 1 << 30;

/// A list of message sizes in bytes, as given to `--sizes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sizes(pub Vec<u64>);

/// Parses `64,4K,1M,64M` (suffixes K, M, G are binary: KiB, MiB, GiB; `B`, `KiB`, `MiB`, `GiB`
/// are accepted too). Every size must be between 1 byte and [`MAX_SIZE`].
pub fn parse_sizes(text: &str) -> Result<Sizes, String> {
    let mut sizes = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(format!(
                "empty size in {text:?}: write sizes separated by commas, like 64,4K,1M"
            ));
        }
        sizes.push(parse_size(part)?);
    }
    Ok(Sizes(sizes))
}

/// Parses a byte limit: `0`, or a size as [`parse_size`] reads it.
pub fn parse_limit(text: &str) -> Result<u64, String> {
    if text == "0" {
        return Ok(0);
    }
    parse_size(text)
}

/// Parses one size; see [`parse_sizes`].
pub fn parse_size(text: &str) -> Result<u64, String> {
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(digits);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("bad size {text:?}: expected a number like 64, 4K, 1M or 64M"))?;
    let shift = match suffix.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        _ => {
            return Err(format!(
                "bad size {text:?}: unknown unit {suffix:?} (use K, M or G, all binary)"
            ))
        }
    };
    let bytes = number
        .checked_mul(1 << shift)
        .filter(|&b| (1..=MAX_SIZE).contains(&b))
        .ok_or_else(|| format!("bad size {text:?}: sizes go from 1 byte to 1G"))?;
    Ok(bytes)
}

/// A size the way `--sizes` takes it: `64 B`, `4 KiB`, `1 MiB`, `1.5 MiB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if bytes >= unit {
            return if bytes % unit == 0 {
                format!("{} {name}", bytes / unit)
            } else {
                format!("{:.1} {name}", bytes as f64 / unit as f64)
            };
        }
    }
    format!("{bytes} B")
}

/// A duration with three significant digits in a unit that suits it.
pub fn human_duration(d: Duration) -> String {
    let ns = d.as_nanos() as f64;
    let (value, unit) = if ns < 1e3 {
        (ns, "ns")
    } else if ns < 1e6 {
        (ns / 1e3, "µs")
    } else if ns < 1e9 {
        (ns / 1e6, "ms")
    } else {
        (ns / 1e9, "s")
    };
    let decimals = if value >= 100.0 {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    format!("{value:.decimals$} {unit}")
}

/// Gigabytes (10^9 bytes) per second for `bytes` moved in `d`.
pub fn gb_per_s(bytes: u64, d: Duration) -> f64 {
    let ns = d.as_nanos();
    if ns == 0 {
        return 0.0;
    }
    bytes as f64 / ns as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(
            parse_sizes("64,4K,1M,64M").unwrap(),
            Sizes(vec![64, 4096, 1 << 20, 64 << 20])
        );
        assert_eq!(parse_size("2KiB").unwrap(), 2048);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert!(parse_size("0").is_err());
        assert!(parse_size("2G").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_sizes("64,,1M").is_err());
        assert_eq!(parse_limit("0").unwrap(), 0);
        assert_eq!(parse_limit("64K").unwrap(), 64 << 10);
        assert!(parse_limit("-1").is_err());
    }

    #[test]
    fn sizes_and_durations_print_compactly() {
        assert_eq!(human_size(64), "64 B");
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(64 << 20), "64 MiB");
        assert_eq!(human_size(1536 << 10), "1.5 MiB");
        assert_eq!(human_duration(Duration::from_nanos(25_300)), "25.3 µs");
        assert_eq!(human_duration(Duration::from_micros(1500)), "1.50 ms");
    }
}
