//! PVE tag lists: how the server normalises them, PVE's tag syntax, and how
//! to derive a valid tag from arbitrary text.

/// Normalises a tag list exactly as PVE stores it: split on `;`, `,` or
/// whitespace, drop empties, lowercase, sort, de-duplicate.
pub fn normalize_tags(s: &str) -> Vec<String> {
    let mut tags: Vec<String> = s
        .split(|c: char| c == ';' || c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(|t| t.to_lowercase())
        .collect();
    tags.sort();
    tags.dedup();
    tags
}

/// Joins tags for the `tags` parameter (PVE's stored form).
pub fn join_tags<S: AsRef<str>>(tags: &[S]) -> String {
    let v: Vec<&str> = tags.iter().map(|t| t.as_ref()).collect();
    v.join(";")
}

/// True if `tag` matches PVE's `[a-z0-9_][a-z0-9_\-+.]*` (case-insensitive).
pub fn is_valid_tag(tag: &str) -> bool {
    let mut bytes = tag.bytes();
    match bytes.next() {
        Some(b) if b.is_ascii_alphanumeric() || b == b'_' => {}
        _ => return false,
    }
    bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'+' | b'.'))
}

/// Maps arbitrary text to a valid lowercase tag: every character outside
/// `[a-z0-9_.+-]` (after ASCII lowercasing) becomes `-`; if the first character
/// is not `[a-z0-9_]` an `_` is prefixed; empty input gives `_`.
pub fn sanitize_tag(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '.' | '+' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    if !out
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        out.insert(0, '_');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_like_pve() {
        assert_eq!(
            normalize_tags("Zeta;alpha,BigFleet  beta\tzeta;;"),
            vec!["alpha", "beta", "bigfleet", "zeta"]
        );
        assert!(normalize_tags(" ; , ").is_empty());
        assert_eq!(join_tags(&normalize_tags("b;a")), "a;b");
    }

    #[test]
    fn sanitize() {
        let t = sanitize_tag("dc1/OnDemand/pve.medium/pve1/007");
        assert_eq!(t, "dc1-ondemand-pve.medium-pve1-007");
        assert!(is_valid_tag(&t));
        assert_eq!(sanitize_tag("-x"), "_-x");
        assert_eq!(sanitize_tag(""), "_");
        assert_eq!(sanitize_tag("A b+c=ü"), "a-b+c--");
        for s in ["", ".", "ü", "a b", "+x", "OK_1.2"] {
            assert!(is_valid_tag(&sanitize_tag(s)), "{s}");
        }
        assert!(!is_valid_tag("-a"));
        assert!(!is_valid_tag("a b"));
        assert!(is_valid_tag("A.b"));
    }

    #[test]
    fn sanitized_tag_survives_normalisation() {
        let t = sanitize_tag("Owner-Cap/X/Y/007");
        assert_eq!(
            normalize_tags(&format!("managed;{t}")),
            vec!["managed".to_string(), t]
        );
    }
}
