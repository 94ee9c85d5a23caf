//! Errors of the safe layer.

use std::ops::Range;

use super::segments::SegmentError;
use crate::verbs::{self, WcStatus};

/// Everything that can go wrong in `snowrdma::safe`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A verb failed, a wait ran out of time, or an operation completed with
    /// an error status (see [`Error::status`]).
    #[error(transparent)]
    Verbs(#[from] verbs::Error),
    /// A segment could not be taken: out of the region, or overlapping one
    /// that is held.
    #[error(transparent)]
    Segment(#[from] SegmentError),
    /// A remote access outside the remote region; nothing was posted.
    #[error("remote bytes {wanted:?} are outside the peer's region of {len} bytes")]
    RemoteOutOfBounds { wanted: Range<u64>, len: u64 },
    /// The call cannot be made with these arguments; nothing was posted.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    /// The completion status, when an operation completed with an error.
    pub fn status(&self) -> Option<WcStatus> {
        match self {
            Error::Verbs(e) => e.completion_status(),
            _ => None,
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }
}

/// Result of the safe layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;
