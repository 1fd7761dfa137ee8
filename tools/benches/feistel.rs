//! Cost of one code: the house AES Feistel permutation, the service's FF1 and the `fpe` crate's general
//! FF1 (which the service's is tested against) on the same domains.
//!
//! Run: `cargo bench --bench feistel -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use cifpool::code::{FeistelPermutation, Ff1Permutation};
use cifpool::keys::PoolKey;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fpe::ff1::{FF1, FlexibleNumeralString};

const DIGITS: [u32; 3] = [9, 10, 12];
const KEY: [u8; 32] = [0x5a; 32];
const BATCH: u64 = 1024;

/// Mean passes through the network per code; explains the spread between digit counts.
fn report_walks() {
    const SAMPLE: u64 = 100_000;
    let key = PoolKey::from_bytes(KEY);
    for digits in [6, 9, 10, 12, 18] {
        let perm = FeistelPermutation::new(&key, digits).unwrap();
        let total: u64 = (0..SAMPLE).map(|c| u64::from(perm.permute_with_walks(c).1)).sum();
        let expected = (1u128 << (2 * perm.half_bits())) as f64 / perm.domain_size() as f64;
        eprintln!(
            "d={digits:>2}: width {} bits, mean walks {:.4} over {SAMPLE} counters (expected {expected:.4})",
            2 * perm.half_bits(),
            total as f64 / SAMPLE as f64,
        );
    }
}

fn to_numerals(mut value: u64, digits: u32) -> Vec<u16> {
    let mut out = vec![0u16; digits as usize];
    for slot in out.iter_mut().rev() {
        *slot = (value % 10) as u16;
        value /= 10;
    }
    out
}

fn bench(c: &mut Criterion) {
    report_walks();
    let key = PoolKey::from_bytes(KEY);
    let mut group = c.benchmark_group("code");
    for digits in DIGITS {
        let perm = FeistelPermutation::new(&key, digits).unwrap();
        let domain = perm.domain_size();
        group.throughput(Throughput::Elements(1));
        group.bench_function(BenchmarkId::new("feistel_permute", digits), |b| {
            let mut counter = 0u64;
            b.iter(|| {
                counter = (counter + 1) % domain;
                black_box(perm.permute(black_box(counter)))
            })
        });

        group.throughput(Throughput::Elements(BATCH));
        group.bench_function(BenchmarkId::new("feistel_permute_many_x1024", digits), |b| {
            let mut out = Vec::with_capacity(BATCH as usize);
            let mut start = 0u64;
            b.iter(|| {
                out.clear();
                perm.permute_many(start..start + BATCH, &mut out);
                start = (start + BATCH) % (domain - BATCH);
                black_box(out.last().copied())
            })
        });

        let ff1 = Ff1Permutation::new(&key, b"individual", digits).unwrap();
        group.throughput(Throughput::Elements(1));
        group.bench_function(BenchmarkId::new("ff1_permute", digits), |b| {
            let mut counter = 0u64;
            b.iter(|| {
                counter = (counter + 1) % domain;
                black_box(ff1.try_permute(black_box(counter)).unwrap())
            })
        });

        let ff1 = FF1::<aes09::Aes256>::new(&KEY, 10).unwrap();
        group.bench_function(BenchmarkId::new("fpe_ff1_encrypt", digits), |b| {
            let mut counter = 0u64;
            b.iter(|| {
                counter = (counter + 1) % domain;
                let input = FlexibleNumeralString::from(to_numerals(counter, digits));
                black_box(ff1.encrypt(&[], &input).unwrap())
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
