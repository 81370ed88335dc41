//! One error type for what a request can fail with, with kinds, and the one place that turns a
//! kind into a gRPC status code. Deeper layers return `anyhow::Error`; where they know the
//! kind (a file that does not decode, a full scratch disk) they put an [`Error`] in its chain,
//! and [`status`] finds it there under any context added on the way up.

use std::fmt;
use tonic::{Code, Status};

/// What went wrong, as far as the client is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// No dataset of that name (NOT_FOUND).
    UnknownDataset,
    /// No open stream of that id, of the caller's process (NOT_FOUND).
    UnknownStream,
    /// The request itself is wrong: a field, a size, a name, an option (INVALID_ARGUMENT).
    BadRequest,
    /// The request is well formed but not for this dataset or connection as they are: a
    /// pipeline the dataset has none of, shared memory over TCP, a client too old for the
    /// dataset's fields (FAILED_PRECONDITION).
    Precondition,
    /// The dataset has no scratch tier to warm (FAILED_PRECONDITION).
    NoScratch,
    /// A dataset of that name exists already (ALREADY_EXISTS).
    Exists,
    /// Not this client's to use (PERMISSION_DENIED).
    Denied,
    /// A budget is spent: shared memory, the scratch disk (RESOURCE_EXHAUSTED).
    Exhausted,
    /// A raw file does not read or decode, and the dataset fails on bad files (DATA_LOSS).
    SourceIo,
    /// A dataset's files changed since the daemon opened it (truncated, rewritten, replaced):
    /// nothing is served from them until it is reopened (FAILED_PRECONDITION).
    Changed,
    /// The dataset is being opened (the daemon listens before it opens its datasets): retry
    /// shortly (UNAVAILABLE).
    Opening,
    /// The daemon is shutting down: reconnect and resume (UNAVAILABLE).
    ShuttingDown,
    /// The reader process of a user's dataset failed (crashed, hung or sent what does not
    /// hold): its streams end, and it is started again after a backoff (UNAVAILABLE).
    Reader,
    /// Anything else: a failure the daemon did not expect (INTERNAL).
    Internal,
}

impl Kind {
    /// The gRPC status code clients see for this kind.
    pub fn code(self) -> Code {
        match self {
            Kind::UnknownDataset | Kind::UnknownStream => Code::NotFound,
            Kind::BadRequest => Code::InvalidArgument,
            Kind::Precondition | Kind::NoScratch | Kind::Changed => Code::FailedPrecondition,
            Kind::Denied => Code::PermissionDenied,
            Kind::Exists => Code::AlreadyExists,
            Kind::Exhausted => Code::ResourceExhausted,
            Kind::SourceIo => Code::DataLoss,
            Kind::ShuttingDown | Kind::Opening | Kind::Reader => Code::Unavailable,
            Kind::Internal => Code::Internal,
        }
    }
}

/// An error of a known kind, with the message the client reads.
#[derive(Debug, Clone)]
pub struct Error {
    kind: Kind,
    message: String,
}

impl Error {
    pub fn new(kind: Kind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The kind of `e`: that of the first [`Error`] in its chain, else `Internal`.
    pub fn kind_of(e: &anyhow::Error) -> Kind {
        // Also inside an I/O error: a read through a source's file interface carries its kind
        // there (an object that changed, a store that did not answer).
        fn inside_io<'a>(c: &'a (dyn std::error::Error + 'static)) -> Option<&'a Error> {
            c.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<Error>())
        }
        e.downcast_ref::<Error>()
            .or_else(|| {
                e.chain()
                    .find_map(|c| c.downcast_ref::<Error>().or_else(|| inside_io(c)))
            })
            .map_or(Kind::Internal, Error::kind)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        Status::new(e.kind.code(), e.message)
    }
}

/// The status for `e` (its kind's code; the whole chain of messages).
pub fn status(e: &anyhow::Error) -> Status {
    Status::new(Error::kind_of(e).code(), format!("{e:#}"))
}

/// Shorthands for handlers: `Err(bad_request(..))?`.
pub fn bad_request(message: impl Into<String>) -> Status {
    Error::new(Kind::BadRequest, message).into()
}

pub fn precondition(message: impl Into<String>) -> Status {
    Error::new(Kind::Precondition, message).into()
}

/// Longest piece of a client's input an error message quotes.
const QUOTED_CHARS: usize = 64;

/// `s` for an error message: debug-quoted, and cut to its first 64 characters (a client's
/// 100 KB name must not come back in a status larger than gRPC's metadata limit).
pub fn quote(s: &str) -> String {
    match s.char_indices().nth(QUOTED_CHARS) {
        None => format!("{s:?}"),
        Some((cut, _)) => format!("{:?}... ({} bytes)", &s[..cut], s.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn the_kind_survives_context_added_on_the_way_up() {
        let e = anyhow::Error::new(Error::new(Kind::SourceIo, "decoding image a.jpg"))
            .context("preprocessing sample 10");
        assert_eq!(Error::kind_of(&e), Kind::SourceIo);
        let s = status(&e);
        assert_eq!(s.code(), Code::DataLoss);
        assert_eq!(s.message(), "preprocessing sample 10: decoding image a.jpg");
        let as_context = anyhow::anyhow!("disk full")
            .context(Error::new(Kind::Exhausted, "scratch tier"))
            .context("warming");
        assert_eq!(Error::kind_of(&as_context), Kind::Exhausted);
        let plain: anyhow::Result<()> = Err(anyhow::anyhow!("oops")).context("somewhere");
        assert_eq!(status(&plain.unwrap_err()).code(), Code::Internal);
    }

    #[test]
    fn quotes_are_short() {
        assert_eq!(quote("cifar"), "\"cifar\"");
        let long = "é".repeat(50_000);
        let q = quote(&long);
        assert!(q.len() < 200 && q.ends_with("(100000 bytes)"), "{q}");
    }
}
