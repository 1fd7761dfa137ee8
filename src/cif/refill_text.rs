//! The `COPY` text of refill batches, encoded one batch ahead on the blocking pool.
//!
//! A refill batch is encode (Feistel, check digit, text: ~5 ms for 10,000 codes), then `COPY` (the
//! server's work). Encoded in line, the server waited for every encoding and the service for every
//! `COPY`. A run knows its next batch's counters before it has them (under the refill lock nobody else
//! advances the counter: they start where this batch ends), so it encodes them while this batch's
//! `COPY` runs. The counters the database hands out stay the truth: text encoded for other counters is
//! thrown away and the right ones are encoded then.

use std::ops::Range;
use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::cif::epochs::KeyEpochs;

/// The `COPY` text of some counters and how many rows it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Encoded {
    /// One line per code.
    pub text: String,
    /// Lines in `text` (the counters less those skipped).
    pub codes: u64,
}

/// Encodes counters of one pool into `COPY cif_codes (pool_id, counter, code)` text.
pub(crate) struct BatchText {
    pool_id: i16,
    keys: Arc<KeyEpochs>,
    ahead: Option<(Range<i64>, JoinHandle<Encoded>)>,
}

impl BatchText {
    /// An encoder for the pool with database id `pool_id` under its key epochs `keys`.
    pub fn new(pool_id: i16, keys: Arc<KeyEpochs>) -> BatchText {
        BatchText { pool_id, keys, ahead: None }
    }

    /// The key epoch this encoder encodes new counters under.
    pub fn epoch(&self) -> i16 {
        self.keys.current().number
    }

    /// Starts encoding `counters` in the background, for a later [`BatchText::text`] of the same range
    /// (replacing any encoding started before).
    pub(crate) fn encode_ahead(&mut self, counters: Range<i64>) {
        let (pool_id, keys) = (self.pool_id, self.keys.clone());
        let range = counters.clone();
        self.ahead = Some((counters, tokio::task::spawn_blocking(move || encode(pool_id, &keys, range))));
    }

    /// The text of `counters`: the one encoded ahead if it was this range, else encoded now.
    pub async fn text(&mut self, counters: Range<i64>) -> Encoded {
        if let Some((range, handle)) = self.ahead.take()
            && range == counters
            && let Ok(text) = handle.await
        {
            return text;
        }
        let (pool_id, keys) = (self.pool_id, self.keys.clone());
        match tokio::task::spawn_blocking(move || encode(pool_id, &keys, counters.clone())).await {
            Ok(text) => text,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
}

fn encode(pool_id: i16, keys: &KeyEpochs, counters: Range<i64>) -> Encoded {
    use std::fmt::Write as _;
    let mut text = String::with_capacity((counters.end - counters.start).max(0) as usize * 32);
    let mut codes = 0;
    for counter in counters {
        if let Some(code) = keys.encode(counter as u64) {
            let _ = writeln!(text, "{pool_id}\t{counter}\t{code}");
            codes += 1;
        }
    }
    Encoded { text, codes }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cif::epochs::KeyEpoch;
    use crate::code::{CheckScheme, CodeFormat, PoolCodec};
    use crate::keys::PoolKey;

    fn codec() -> PoolCodec {
        let format = CodeFormat::new("9", 8, CheckScheme::Luhn).unwrap();
        PoolCodec::new(format, &PoolKey::from_bytes([7; 32])).unwrap()
    }

    fn keys(codec: &PoolCodec) -> Arc<KeyEpochs> {
        let epoch0 = KeyEpoch { number: 0, key_id: "k".into(), first_counter: 0, codec: codec.clone() };
        Arc::new(KeyEpochs::new(vec![epoch0]))
    }

    fn expected(codec: &PoolCodec, counters: Range<i64>) -> Encoded {
        let codes = (counters.end - counters.start) as u64;
        Encoded { text: counters.map(|c| format!("3\t{c}\t{}\n", codec.encode(c as u64))).collect(), codes }
    }

    #[tokio::test]
    async fn the_text_is_the_same_encoded_ahead_or_now() {
        let codec = codec();
        let mut text = BatchText::new(3, keys(&codec));
        assert_eq!(text.text(0..5).await, expected(&codec, 0..5));
        text.encode_ahead(5..10);
        assert_eq!(text.text(5..10).await, expected(&codec, 5..10));
    }

    #[tokio::test]
    async fn text_encoded_for_other_counters_is_not_used() {
        let codec = codec();
        let mut text = BatchText::new(3, keys(&codec));
        text.encode_ahead(10..20);
        assert_eq!(text.text(20..25).await, expected(&codec, 20..25));
        // The encoding ahead was spent on the miss; the next ask encodes again.
        assert_eq!(text.text(10..20).await, expected(&codec, 10..20));
    }
}
