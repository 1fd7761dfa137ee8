//! Cost of sealing one job's recipient and payload at intake and opening them after the claim, for an
//! OTP and for a promotional message of a few hundred bytes.
//!
//! Run: `cargo bench --bench seal -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use cifpool::internals::seal::Seal;
use cifpool::keys::MasterKey;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

fn bench(c: &mut Criterion) {
    let seal = Seal::new(&MasterKey::from_bytes([0x5a; 32]), "bench", true);
    let promo = format!(r#"{{"title":"Spring offer","body":"{}","deep_link":"app://offers/77"}}"#, "x".repeat(300));
    let mut group = c.benchmark_group("personal_data");
    for (name, recipient, payload) in
        [("otp", "+84901234567", r#"{"code":"918273"}"#), ("promo", "device-token-0123456789abcdef", promo.as_str())]
    {
        group.throughput(Throughput::Elements(1));
        group.bench_function(BenchmarkId::new("seal", name), |b| {
            b.iter(|| black_box(seal.seal(black_box(recipient), black_box(payload))))
        });
        let sealed = seal.seal(recipient, payload);
        group.bench_function(BenchmarkId::new("open", name), |b| {
            b.iter(|| black_box(seal.open(black_box("bench"), black_box(&sealed)).unwrap()))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
