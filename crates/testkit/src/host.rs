//! What a test needs from the host it runs on: whether a process still
//! lives, and tools that are skipped without locally but required in CI.

/// Whether a live process (not a zombie) has this pid (Linux `/proc`).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // Field 3, after the parenthesised name, is the state; Z = zombie.
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// Whether this run is CI's (`CI=true`), where every optional tool must be
/// present so that nothing CI is trusted for is skipped.
pub fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// A tool a test needs, as `found` says: the tool when present; when
/// missing, `None` after reporting the skip ([`crate::skip::report`]; the
/// test returns early), or under `CI=true` a failure, as CI must exercise
/// it. `why` names what is missing and how to install it.
pub fn or_skip<T>(found: Result<T, String>) -> Option<T> {
    match found {
        Ok(tool) => Some(tool),
        Err(why) if in_ci() => panic!("CI=true requires it: {why}"),
        Err(why) => {
            crate::skip::report(&crate::skip::current_test(), &why);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_free_pid_is_not() {
        assert!(alive(std::process::id()));
        // Above the kernel's pid_max (at most 2^22).
        assert!(!alive(u32::MAX));
    }
}
