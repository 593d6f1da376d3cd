//! Error reports for people: an error and its causes on one line, each
//! cause once (a library error that already names its cause in its message
//! is not followed by the same text again).

/// `e` and its sources, joined by ": ", skipping any cause whose text the
/// line already holds.
pub fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let s = c.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("memory server A: cannot connect: {source}")]
    struct Connect {
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("opening the device")]
    struct Open {
        #[source]
        inner: Connect,
    }

    #[test]
    fn each_cause_once() {
        let e = Open {
            inner: Connect {
                source: std::io::Error::from_raw_os_error(111),
            },
        };
        let line = describe(&e);
        assert_eq!(line.matches("Connection refused").count(), 1, "{line}");
        assert_eq!(line.matches("memory server A").count(), 1, "{line}");
        assert!(
            line.starts_with("opening the device: memory server A"),
            "{line}"
        );
    }
}
