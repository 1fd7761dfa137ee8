//! The request body as a blocking [`std::io::Read`], for the parser on its blocking thread: each read
//! that finds the current frame used up waits on the runtime for the next one, so only a frame or two of
//! the body is ever in memory, however large the body.

use std::io::{self, Read};

use axum::body::{Body, BodyDataStream, Bytes};
use futures_util::StreamExt as _;
use tokio::runtime::Handle;

/// Why the body could not be read to its end.
#[derive(Debug, thiserror::Error)]
pub enum BodyFailure {
    /// It grew past the batch endpoint's body limit (`queue.batch_body_limit_bytes`) while streaming.
    #[error("the request body is larger than the batch body limit")]
    TooLarge,
    /// The connection broke or the client stopped sending before the declared end.
    #[error("the request body could not be read to its end: {0}")]
    Broken(String),
}

/// A blocking reader over an HTTP body; must be used from a thread where blocking is allowed
/// ([`tokio::task::spawn_blocking`]), never from an async task.
pub struct BodyReader {
    frames: BodyDataStream,
    runtime: Handle,
    current: Bytes,
}

impl BodyReader {
    /// Reads `body`, waiting for its frames on `runtime`.
    pub fn new(body: Body, runtime: Handle) -> BodyReader {
        BodyReader { frames: body.into_data_stream(), runtime, current: Bytes::new() }
    }
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            match self.runtime.block_on(self.frames.next()) {
                None => return Ok(0),
                Some(Ok(frame)) => self.current = frame,
                Some(Err(e)) => return Err(io::Error::other(classify(e))),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// The body limit layer fails the stream with `LengthLimitError`, somewhere down the error's sources.
fn classify(e: axum::Error) -> BodyFailure {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = source {
        if err.is::<http_body_util::LengthLimitError>() {
            return BodyFailure::TooLarge;
        }
        source = err.source();
    }
    BodyFailure::Broken(e.to_string())
}

/// The [`BodyFailure`] behind a read error of [`BodyReader`], if that is what it is.
pub fn body_failure(e: &io::Error) -> Option<&BodyFailure> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<BodyFailure>())
}
