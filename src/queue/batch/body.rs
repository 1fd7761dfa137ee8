//! A batch's bytes, as they arrive (an HTTP request body's frames, or any other stream of chunks), as
//! a blocking [`std::io::Read`] for the parser on its blocking thread: each read that finds the current
//! chunk used up waits on the runtime for the next one, so only a chunk or two of the batch is ever in
//! memory, however large the batch.

use std::io::{self, Read};

use bytes::Bytes;
use futures_util::StreamExt as _;
use futures_util::stream::BoxStream;
use tokio::runtime::Handle;

/// Why the body could not be read to its end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BodyFailure {
    /// It grew past the batch endpoint's body limit (`queue.batch_body_limit_bytes`) while streaming.
    #[error("the request body is larger than the batch body limit")]
    TooLarge,
    /// The client sends more slowly than `queue.batch_min_bytes_per_second` (see [`BodyReader`]).
    #[error("the request body arrives more slowly than {0} bytes per second")]
    TooSlow(u64),
    /// One job of the batch is longer than any valid job can be (see [`JobBound`]).
    #[error("a job is longer than {0} bytes of JSON")]
    JobTooLong(usize),
    /// The connection broke or the client stopped sending before the declared end.
    #[error("the request body could not be read to its end: {0}")]
    Broken(String),
}

/// A batch's chunks as they arrive; a chunk that fails ends the batch (see [`BodyFailure`]).
pub type ByteStream = BoxStream<'static, Result<Bytes, BoxError>>;

/// Any error a byte stream may end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A blocking reader over a byte stream; must be used from a thread where blocking is allowed
/// ([`tokio::task::spawn_blocking`]), never from an async task.
///
/// A batch holds one of the instance's few batch slots, a database connection and a transaction
/// while its body arrives, so a client that trickles its body must not keep them for the whole
/// request deadline: after [`SLOW_GRACE`], the body must have arrived at `min_rate` bytes per second
/// on average, or the read fails with [`BodyFailure::TooSlow`] (408).
pub(crate) struct BodyReader {
    frames: ByteStream,
    runtime: Handle,
    current: Bytes,
    started: tokio::time::Instant,
    received: u64,
    min_rate: u64,
}

/// How long a batch body may take before its average rate is held to the minimum.
pub(crate) const SLOW_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

impl BodyReader {
    /// Reads `frames`, waiting for them on `runtime`, at `min_rate` bytes per second at least (0: any
    /// rate).
    pub fn new(frames: ByteStream, runtime: Handle, min_rate: u64) -> BodyReader {
        let started = tokio::time::Instant::now();
        BodyReader { frames, runtime, current: Bytes::new(), started, received: 0, min_rate }
    }

    /// When the next frame must have arrived by, at the minimum rate.
    fn deadline(&self) -> Option<tokio::time::Instant> {
        (self.min_rate > 0).then(|| {
            self.started + SLOW_GRACE + std::time::Duration::from_secs_f64(self.received as f64 / self.min_rate as f64)
        })
    }
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            let deadline = self.deadline();
            let next = self.runtime.block_on(async {
                match deadline {
                    Some(at) => tokio::time::timeout_at(at, self.frames.next()).await.ok(),
                    None => Some(self.frames.next().await),
                }
            });
            match next {
                None => return Err(io::Error::other(BodyFailure::TooSlow(self.min_rate))),
                Some(None) => return Ok(0),
                Some(Some(Ok(frame))) => {
                    self.received += frame.len() as u64;
                    self.current = frame;
                }
                Some(Some(Err(e))) => return Err(io::Error::other(classify(e))),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// The body limit layer fails the stream with `LengthLimitError`, somewhere down the error's sources.
fn classify(e: BoxError) -> BodyFailure {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e.as_ref());
    while let Some(err) = source {
        if err.is::<http_body_util::LengthLimitError>() {
            return BodyFailure::TooLarge;
        }
        source = err.source();
    }
    BodyFailure::Broken(e.to_string())
}

/// The [`BodyFailure`] behind a read error of [`BodyReader`], if that is what it is.
pub(crate) fn body_failure(e: &io::Error) -> Option<&BodyFailure> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<BodyFailure>())
}

/// Counts the bytes read since the parser marked the start of a job, and fails the read once one job
/// has taken more than `limit`: the parser holds a job's text whole, so without a bound one job of a
/// 128 MiB batch could take that much memory before any check sees it.
pub(crate) struct JobBound<R> {
    inner: R,
    since_job: std::rc::Rc<std::cell::Cell<Option<usize>>>,
    limit: usize,
}

impl<R> JobBound<R> {
    /// Bounds `inner`; the parser sets the shared count to `Some(0)` as each job starts and `None`
    /// outside the jobs.
    pub fn new(inner: R, since_job: std::rc::Rc<std::cell::Cell<Option<usize>>>, limit: usize) -> JobBound<R> {
        JobBound { inner, since_job, limit }
    }
}

impl<R: Read> Read for JobBound<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(read) = self.since_job.get() {
            let read = read + n;
            if read > self.limit {
                return Err(io::Error::other(BodyFailure::JobTooLong(self.limit)));
            }
            self.since_job.set(Some(read));
        }
        Ok(n)
    }
}
