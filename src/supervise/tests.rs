use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

fn supervisor() -> Supervisor {
    Supervisor::new(Arc::default(), CancellationToken::new())
}

#[tokio::test(start_paused = true)]
async fn a_panicking_loop_is_restarted_and_counted_down_meanwhile() {
    let liveness = Arc::new(Liveness::default());
    let runs = Arc::new(AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let supervisor = {
        let (liveness, runs, stop) = (liveness.clone(), runs.clone(), stop.clone());
        tokio::spawn(async move {
            supervised("claim loop".into(), &liveness, stop.clone(), RestartPolicy::default(), move || {
                let (runs, stop) = (runs.clone(), stop.clone());
                async move {
                    // The first two runs panic; the third runs until the stop.
                    if runs.fetch_add(1, Ordering::SeqCst) < 2 {
                        panic!("injected");
                    }
                    stop.cancelled().await;
                }
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(liveness.down(), vec!["claim loop".to_string()], "down during the back-off");
    tokio::time::sleep(RestartPolicy::default().first_backoff * 3 + Duration::from_millis(50)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 3, "restarted twice, the second wait doubled");
    assert!(liveness.down().is_empty(), "running again");
    stop.cancel();
    supervisor.await.unwrap().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 3, "a loop that ends at its stop is not restarted");
    assert_eq!(liveness.down(), vec!["claim loop".to_string()]);
}

#[tokio::test(start_paused = true)]
async fn a_loop_that_returns_before_its_stop_is_restarted() {
    let mut tasks = supervisor();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    tasks.keep_running("relay", move |stop| {
        let runs = counted.clone();
        async move {
            if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                return; // as a loop whose connection broke and that forgot to retry
            }
            stop.cancelled().await;
        }
    });
    tokio::time::sleep(RestartPolicy::default().first_backoff + Duration::from_millis(50)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert!(tasks.liveness().down().is_empty());
    tasks.stop().cancel();
    assert!(tasks.drain(Duration::from_secs(1)).await);
}

#[tokio::test(start_paused = true)]
async fn a_loop_that_keeps_panicking_is_given_up_and_reported() {
    let mut tasks = supervisor();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    tasks.keep_running("provider budget sync", move |_stop| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { panic!("always") }
    });
    tasks.every("pool gauges", Duration::from_secs(10), || async {});
    let failure = tokio::time::timeout(Duration::from_secs(120), tasks.first_failure()).await.expect("reported");
    assert_eq!(failure.task, "provider budget sync");
    assert_eq!(failure.how, "failed 10 times in a row, the last time panicked: always");
    assert_eq!(runs.load(Ordering::SeqCst), RestartPolicy::default().give_up_after as usize);
    assert_eq!(tasks.liveness().down(), vec!["provider budget sync".to_string()], "readiness sees it down");
    tasks.stop().cancel();
    assert!(tasks.drain(Duration::from_secs(1)).await, "the healthy loop ends at the stop");
}

#[tokio::test(start_paused = true)]
async fn a_task_that_cannot_restart_is_a_failure_when_it_panics_and_none_after_the_stop() {
    let mut tasks = supervisor();
    tasks.run_once("worker group otp", async { panic!("injected") });
    let failure = tasks.first_failure().await;
    assert_eq!(failure.task, "worker group otp");
    assert_eq!(failure.how, "panicked: injected");

    let mut tasks = supervisor();
    let stop = tasks.stop().clone();
    tasks.run_once("worker group promo", async move { stop.cancelled().await });
    tasks.stop().cancel();
    let none = tokio::time::timeout(Duration::from_secs(1), tasks.first_failure()).await;
    assert!(none.is_err(), "an end after the stop is no failure");
}

#[tokio::test(start_paused = true)]
async fn every_runs_rounds_at_its_period_until_the_stop() {
    let mut tasks = supervisor();
    let rounds = Arc::new(AtomicUsize::new(0));
    let counted = rounds.clone();
    tasks.every("stager", Duration::from_secs(1), move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async {}
    });
    assert_eq!(tasks.names(), ["stager".to_string()]);
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert_eq!(rounds.load(Ordering::SeqCst), 4, "at 0, 1, 2 and 3 s");
    tasks.stop().cancel();
    assert!(tasks.drain(Duration::from_secs(1)).await);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(rounds.load(Ordering::SeqCst), 4, "none after the stop");
}
