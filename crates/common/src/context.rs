//! Saying what was being done when something failed: `.context("reading
//! the config")?` on a `Result` or an `Option`, giving a typed [`Failed`]
//! that each crate's error enum takes in (`#[from]`).

use std::fmt::Display;

/// Something failed while doing `what` (or something needed was missing).
#[derive(Debug, thiserror::Error)]
#[error("{what}{}", cause.as_ref().map(|c| format!(": {c}")).unwrap_or_default())]
pub struct Failed {
    /// What was being done, or what was missing.
    pub what: String,
    /// Why (its text is part of this error's message).
    pub cause: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// Attach what was being done to a failure.
pub trait Context<T> {
    /// With `what` said up front.
    fn context(self, what: impl Display) -> Result<T, Failed>;
    /// With the description made only on failure.
    fn with_context<D: Display>(self, f: impl FnOnce() -> D) -> Result<T, Failed>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for Result<T, E> {
    fn context(self, what: impl Display) -> Result<T, Failed> {
        self.map_err(|e| Failed {
            what: what.to_string(),
            cause: Some(Box::new(e)),
        })
    }
    fn with_context<D: Display>(self, f: impl FnOnce() -> D) -> Result<T, Failed> {
        self.map_err(|e| Failed {
            what: f().to_string(),
            cause: Some(Box::new(e)),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl Display) -> Result<T, Failed> {
        self.ok_or_else(|| Failed {
            what: what.to_string(),
            cause: None,
        })
    }
    fn with_context<D: Display>(self, f: impl FnOnce() -> D) -> Result<T, Failed> {
        self.ok_or_else(|| Failed {
            what: f().to_string(),
            cause: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn says_what_and_why_once() {
        let e = "x".parse::<u32>().context("reading the port").unwrap_err();
        assert_eq!(
            e.to_string(),
            "reading the port: invalid digit found in string"
        );
        let e = None::<u32>.context("no port given").unwrap_err();
        assert_eq!(e.to_string(), "no port given");
        assert_eq!(crate::report::describe(&e), "no port given");
    }
}
