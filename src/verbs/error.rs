//! Errors of the verbs layer: each names the verb that failed and why
//! (its errno, or the completion status the device reported).

use std::fmt;
use std::io;
use std::time::Duration;

use super::cm::CmEventKind;
use super::cq::WcStatus;

/// Everything that can go wrong in the verbs layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A verb returned an error code; `source` carries its errno.
    #[error("{verb} failed: {source}")]
    Verb {
        verb: &'static str,
        #[source]
        source: io::Error,
    },
    /// A work request completed with a status other than success.
    #[error("work request {wr_id} completed with {status} (vendor error {vendor_err:#x})")]
    Completion {
        wr_id: u64,
        status: WcStatus,
        vendor_err: u32,
    },
    /// A wait ran out of time: the completion or event never came.
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout {
        what: &'static str,
        timeout: Duration,
    },
    /// RDMA CM reported something other than the event that was waited for.
    #[error("RDMA CM: waited for {expected}, got {got} (status {status}: {})", cm_status_text(*.status))]
    CmEvent {
        expected: CmEventKind,
        got: CmEventKind,
        status: i32,
    },
    /// No RDMA device is present on this host.
    #[error("no RDMA device found")]
    NoDevice,
    /// No RDMA device has this name.
    #[error("no RDMA device named {0:?}")]
    NoSuchDevice(String),
    /// The caller passed something the verbs cannot take.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A self-test found data that differs from what was sent.
    #[error("verification failed: {0}")]
    Verification(String),
}

/// Result of the verbs layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The completion status, when the error is a failed work completion.
    pub fn completion_status(&self) -> Option<WcStatus> {
        match self {
            Error::Completion { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether this error is a wait that ran out of time.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// The errno behind the error, where there is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Verb { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// For verbs that return NULL or -1 and set errno.
    pub(crate) fn last_os(verb: &'static str) -> Error {
        Error::Verb {
            verb,
            source: io::Error::last_os_error(),
        }
    }

    /// For verbs that return the errno itself (`ibv_post_send`, `ibv_modify_qp`, ...).
    pub(crate) fn from_code(verb: &'static str, code: i32) -> Error {
        Error::Verb {
            verb,
            source: io::Error::from_raw_os_error(code.abs()),
        }
    }

    pub(crate) fn invalid(what: impl fmt::Display) -> Error {
        Error::InvalidArgument(what.to_string())
    }
}

/// Turns a verb's return value into a `Result`, for verbs that return an
/// errno (positive or negative) directly.
pub(crate) fn check_code(verb: &'static str, rc: i32) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::from_code(verb, rc))
    }
}

/// Turns a verb's return value into a `Result`, for verbs that return -1 and
/// set errno.
pub(crate) fn check_errno(verb: &'static str, rc: i32) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::last_os(verb))
    }
}

/// RDMA CM status codes in events are negative errnos for local failures and
/// IB/RoCE reject reasons for rejects; say which.
fn cm_status_text(status: i32) -> String {
    match status {
        0 => "none".to_string(),
        s if s < 0 => io::Error::from_raw_os_error(-s).to_string(),
        s => format!("reject reason {s}"),
    }
}
