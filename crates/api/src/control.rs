//! A runner's control socket: one JSON request line, JSON reply lines.
//! Every request but `migrate` gets one reply line; `migrate` streams
//! [`crate::ProgressEvent`]s and ends with a report or a failure.

use crate::migration::MigrateRequest;
use serde::{Deserialize, Serialize};

/// A request to a runner.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum ControlRequest {
    /// The guest's [`crate::GuestStatus`].
    Status,
    /// Migrate the guest away (progress lines, then a report or failure).
    Migrate(MigrateRequest),
    /// Move the guest's pages on one memory server to another (reply: [`Moved`]).
    Evacuate {
        /// The memory server emptied.
        from: String,
        /// The memory server that takes the pages.
        to: String,
    },
    /// Sort job: sort the records now (reply: [`crate::guest::SortResult`]).
    Sort,
    /// Cancel a migration in progress (reply: [`crate::Ok`]).
    Cancel,
    /// Change how many pages may be resident (reply: [`Budget`]).
    SetBudget {
        /// The new budget.
        pages: u64,
    },
    /// End the guest: its pages on memory servers are deleted (reply: [`crate::Ok`]).
    Stop,
}

/// The reply to [`ControlRequest::Evacuate`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Moved {
    /// Pages moved.
    pub moved: u64,
}

/// The reply to [`ControlRequest::SetBudget`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Budget {
    /// The budget now in force.
    pub budget_pages: u64,
}

/// One reply line: the expected value, or an error.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum ControlReply<T> {
    /// The request failed.
    Err(crate::ErrorReply),
    /// The request's result.
    Ok(T),
}

impl<T> ControlReply<T> {
    /// The result, or the runner's error message.
    pub fn into_result(self) -> Result<T, String> {
        match self {
            ControlReply::Ok(t) => Ok(t),
            ControlReply::Err(e) => Err(e.error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        for (r, wire) in [
            (ControlRequest::Status, r#"{"op":"status"}"#),
            (
                ControlRequest::SetBudget { pages: 7 },
                r#"{"op":"set_budget","pages":7}"#,
            ),
        ] {
            assert_eq!(serde_json::to_string(&r).unwrap(), wire);
            assert_eq!(serde_json::from_str::<ControlRequest>(wire).unwrap(), r);
        }
        assert!(serde_json::from_str::<ControlRequest>(r#"{"op":"exec","cmd":"id"}"#).is_err());
    }

    #[test]
    fn an_error_line_is_an_error() {
        let r: ControlReply<Budget> = serde_json::from_str(r#"{"error":"no"}"#).unwrap();
        assert_eq!(r.into_result(), Err("no".to_string()));
        let r: ControlReply<Budget> = serde_json::from_str(r#"{"budget_pages":3}"#).unwrap();
        assert_eq!(r.into_result(), Ok(Budget { budget_pages: 3 }));
    }
}
