//! The client side of a runner's control socket (see
//! [`pagefleet_api::control`]): one typed request line, typed reply lines.

use pagefleet_api::control::ControlReply;
use pagefleet_api::ControlRequest;
use serde::de::DeserializeOwned;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What went wrong talking to a runner.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The socket could not be reached (the runner is gone).
    #[error("runner control {path}: {source}")]
    Connect {
        /// The control socket.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The runner did not answer in time.
    #[error("runner control {path}: no answer within {secs} s")]
    TimedOut {
        /// The control socket.
        path: PathBuf,
        /// The timeout that passed.
        secs: u64,
    },
    /// The connection failed midway.
    #[error("runner control {path}: {source}")]
    Io {
        /// The control socket.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The runner closed the connection without a reply.
    #[error("runner control {0}: closed without a reply")]
    NoReply(PathBuf),
    /// A reply that is not the expected JSON.
    #[error("runner control {path}: malformed reply: {what}")]
    Malformed {
        /// The control socket.
        path: PathBuf,
        /// What was wrong.
        what: String,
    },
    /// The runner refused the request.
    #[error("{0}")]
    Refused(String),
}

/// Connect and send one request; the stream to read replies from.
pub fn send(
    path: &Path,
    req: &ControlRequest,
    timeout: Option<Duration>,
) -> Result<UnixStream, ControlError> {
    let mut s = UnixStream::connect(path).map_err(|source| ControlError::Connect {
        path: path.into(),
        source,
    })?;
    let _ = s.set_read_timeout(timeout);
    let mut b = serde_json::to_vec(req).map_err(|e| ControlError::Malformed {
        path: path.into(),
        what: e.to_string(),
    })?;
    b.push(b'\n');
    s.write_all(&b).map_err(|source| ControlError::Io {
        path: path.into(),
        source,
    })?;
    Ok(s)
}

fn read_error(path: &Path, e: std::io::Error, timeout: Option<Duration>) -> ControlError {
    match (e.kind(), timeout) {
        (std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut, Some(t)) => {
            ControlError::TimedOut {
                path: path.into(),
                secs: t.as_secs(),
            }
        }
        _ => ControlError::Io {
            path: path.into(),
            source: e,
        },
    }
}

/// One request, one reply of type `T` (waiting at most `timeout`).
pub fn call<T: DeserializeOwned>(
    path: &Path,
    req: &ControlRequest,
    timeout: Duration,
) -> Result<T, ControlError> {
    let s = send(path, req, Some(timeout))?;
    let mut line = String::new();
    BufReader::new(s.take(crate::http::MAX_LINE as u64))
        .read_line(&mut line)
        .map_err(|e| read_error(path, e, Some(timeout)))?;
    if line.is_empty() {
        return Err(ControlError::NoReply(path.into()));
    }
    serde_json::from_str::<ControlReply<T>>(&line)
        .map_err(|e| ControlError::Malformed {
            path: path.into(),
            what: e.to_string(),
        })?
        .into_result()
        .map_err(ControlError::Refused)
}

/// Read reply lines of type `T` from `s` until `each` returns false or the
/// runner closes the connection. An error line ends it as [`ControlError::Refused`].
pub fn read_lines<T: DeserializeOwned>(
    path: &Path,
    s: UnixStream,
    mut each: impl FnMut(T) -> bool,
) -> Result<(), ControlError> {
    let mut r = BufReader::new(s);
    loop {
        let mut line = String::new();
        let n = (&mut r)
            .take(crate::http::MAX_LINE as u64)
            .read_line(&mut line)
            .map_err(|e| read_error(path, e, None))?;
        if n == 0 {
            return Ok(());
        }
        let v = serde_json::from_str::<ControlReply<T>>(&line)
            .map_err(|e| ControlError::Malformed {
                path: path.into(),
                what: e.to_string(),
            })?
            .into_result()
            .map_err(ControlError::Refused)?;
        if !each(v) {
            return Ok(());
        }
    }
}
