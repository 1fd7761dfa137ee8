use proptest::prelude::*;

use super::*;

#[test]
fn everyone_gets_their_want_when_it_all_fits() {
    assert_eq!(water_fill(100, &[10, 20, 30]), vec![10, 20, 30]);
    assert_eq!(water_fill(0, &[10, 20]), vec![0, 0]);
    assert_eq!(water_fill(5, &[]), Vec::<u32>::new());
}

#[test]
fn small_wants_are_met_and_the_rest_share_equally() {
    assert_eq!(water_fill(21, &[1, 100, 100]), vec![1, 10, 10]);
    assert_eq!(water_fill(30, &[100, 5, 100, 100]), vec![8, 5, 8, 9], "25 over three: the remainder to the last");
    assert_eq!(water_fill(10, &[5, 5, 5]), vec![3, 3, 4]);
}

proptest! {
    #[test]
    fn water_fill_is_bounded_work_conserving_and_max_min_fair(
        budget in 0u32..500,
        wants in proptest::collection::vec(0u32..200, 0..12),
    ) {
        let out = water_fill(budget, &wants);
        prop_assert_eq!(out.len(), wants.len());
        let total: u64 = out.iter().map(|&x| u64::from(x)).sum();
        let wanted: u64 = wants.iter().map(|&x| u64::from(x)).sum();
        prop_assert!(total <= u64::from(budget), "never above the budget");
        prop_assert!(out.iter().zip(&wants).all(|(o, w)| o <= w), "never above a want");
        prop_assert_eq!(total, wanted.min(u64::from(budget)), "nothing left idle that someone wants");
        // Max-min fair: one who got less than they wanted got at least as much as anyone else, but
        // for the one unit of an indivisible remainder.
        for (i, (&got, &want)) in out.iter().zip(&wants).enumerate() {
            if got < want {
                for (j, &other) in out.iter().enumerate() {
                    prop_assert!(got + 1 >= other, "{i} got {got} < want {want}, but {j} got {other}");
                }
            }
        }
    }
}

#[test]
fn divide_caps_the_fair_part_by_what_the_others_hold() {
    let others = [Share { held: 15, want: 40 }];
    // Fair would be 10 each of 20, but the other pod still holds 15: only 5 are free.
    assert_eq!(divide(20, &others, 40), Portion { fair: 10, ceiling: 5, allowed: 5 });
    assert_eq!(divide(20, &others, 40).recorded(7), 7, "units in flight stay recorded");
    assert_eq!(divide(0, &others, 40).allowed, 0, "a paused provider gives nothing");
}

/// A pod as the simulation sees it: the share it recorded, the cap it sends within, its sends.
#[derive(Debug, Clone, Copy, Default)]
struct Pod {
    recorded: u32,
    cap: u32,
    in_flight: u32,
}

/// One event of the simulated deployment.
#[derive(Debug, Clone)]
enum Event {
    /// Pod `pod` syncs wanting `want` (syncs are serialised by the provider row's lock).
    Sync { pod: usize, want: u32 },
    /// Pod `pod` starts up to `n` sends within its cap.
    Start { pod: usize, n: u32 },
    /// Pod `pod` ends up to `n` of its sends.
    End { pod: usize, n: u32 },
    /// The deployment's limit changes (an overload cut, regrowth).
    Limit(u32),
}

fn events(pods: usize, limit_changes: bool) -> impl Strategy<Value = Vec<Event>> {
    let limit = if limit_changes { 1 } else { 0 };
    let event = prop_oneof![
        3 => (0..pods, 0u32..60).prop_map(|(pod, want)| Event::Sync { pod, want }),
        3 => (0..pods, 0u32..30).prop_map(|(pod, n)| Event::Start { pod, n }),
        3 => (0..pods, 0u32..30).prop_map(|(pod, n)| Event::End { pod, n }),
        limit => (1u32..60).prop_map(Event::Limit),
    ];
    proptest::collection::vec(event, 1..300)
}

/// A sync as `ProviderBudget::sync` makes it: the share recorded is at least what is in flight, and
/// the pod then sends within what it is allowed. (The real sync shrinks the cap before its
/// transaction and grows it after the commit, for sends that start meanwhile; events here are one at
/// a time.)
fn sync(pods: &mut [Pod], me: usize, limit: u32, want: u32, wants: &mut [u32]) {
    wants[me] = want;
    let others: Vec<Share> =
        (0..pods.len()).filter(|&i| i != me).map(|i| Share { held: pods[i].recorded, want: wants[i] }).collect();
    let portion = divide(limit, &others, want);
    let pod = &mut pods[me];
    pod.recorded = portion.recorded(pod.in_flight);
    pod.cap = portion.allowed;
}

/// Plays `events` on four pods starting at `limit`, checking after each event that every send is within
/// its pod's recorded share and that the shares together never grow past the limit in force; returns
/// the most sends in flight and the largest sum of shares seen.
fn play(mut limit: u32, events: Vec<Event>) -> Result<(u32, u32), TestCaseError> {
    let mut pods = [Pod::default(); 4];
    let mut wants = [0u32; 4];
    let mut peak = (0, 0);
    for e in events {
        let recorded_before: u32 = pods.iter().map(|p| p.recorded).sum();
        match e {
            Event::Sync { pod, want } => sync(&mut pods, pod, limit, want, &mut wants),
            Event::Start { pod, n } => {
                let p = &mut pods[pod];
                p.in_flight += p.cap.saturating_sub(p.in_flight).min(n);
            }
            Event::End { pod, n } => {
                let p = &mut pods[pod];
                p.in_flight -= p.in_flight.min(n);
            }
            Event::Limit(l) => limit = l,
        }
        let recorded: u32 = pods.iter().map(|p| p.recorded).sum();
        prop_assert!(pods.iter().all(|p| p.in_flight <= p.recorded), "a send outside its share: {pods:?}");
        // After a cut the shares sum above the new limit until their sends end and the pods sync
        // again, but no event makes them grow while they are above it.
        prop_assert!(recorded <= recorded_before.max(limit), "grew past the limit {limit}: {pods:?}");
        let in_flight: u32 = pods.iter().map(|p| p.in_flight).sum();
        peak = (peak.0.max(in_flight), peak.1.max(recorded));
    }
    Ok(peak)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// The budget's safety argument played out: whatever the order of syncs and sends, the sends in
    /// flight across the deployment never exceed a limit that holds still.
    #[test]
    fn sends_in_flight_never_exceed_a_steady_limit(limit in 1u32..60, events in events(4, false)) {
        let (in_flight, recorded) = play(limit, events)?;
        prop_assert!(in_flight <= limit && recorded <= limit, "{in_flight} in flight, {recorded} recorded");
    }

    /// With the limit cut and grown meanwhile, the shares never grow past the limit in force.
    #[test]
    fn shares_never_grow_past_a_changing_limit(limit in 1u32..60, events in events(4, true)) {
        play(limit, events)?;
    }
}

#[test]
fn busy_pods_converge_to_equal_shares_of_the_whole_limit() {
    let mut pods = [Pod::default(); 3];
    let mut wants = [0u32; 3];
    // Two rounds: in the first, pods that sync early are held to what the later ones do not yet hold.
    for _ in 0..2 {
        for me in 0..3 {
            sync(&mut pods, me, 20, 100, &mut wants);
        }
    }
    let caps: Vec<u32> = pods.iter().map(|p| p.cap).collect();
    assert_eq!(caps.iter().sum::<u32>(), 20, "{caps:?}");
    assert!(caps.iter().max().unwrap() - caps.iter().min().unwrap() <= 1, "{caps:?}");
    // A cut to 8: each pod, idle now, shrinks at its next sync, and none grows past the new limit.
    for me in 0..3 {
        sync(&mut pods, me, 8, 100, &mut wants);
    }
    for me in 0..3 {
        sync(&mut pods, me, 8, 100, &mut wants);
    }
    let caps: Vec<u32> = pods.iter().map(|p| p.cap).collect();
    assert_eq!(caps.iter().sum::<u32>(), 8, "{caps:?}");
}
