//! Limits per caller, so one caller cannot crowd out the others: a request rate per API key, and a
//! budget of failed authentications per client address (an unknown key, a wrong console sign-in),
//! both per pod and answered 429 with `Retry-After`. And who the client is: the socket's peer or, when
//! that peer is a configured trusted proxy, the address its `X-Forwarded-For` names.

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::ConnectInfo;
use axum::http::HeaderMap;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};
use ipnet::IpNet;

use crate::config::SecuritySettings;

/// Limiter entries kept before the stale ones are dropped (bounds memory under many addresses).
const MAX_TRACKED: usize = 100_000;

/// The client's address, as [`client_address`] found it, in the request's extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub Option<IpAddr>);

impl std::fmt::Display for ClientAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(ip) => write!(f, "{ip}"),
            None => f.write_str("-"),
        }
    }
}

/// The client's address: the socket's peer, unless that peer is one of `trusted` proxies, in which
/// case the right-most `X-Forwarded-For` entry that is not itself a trusted proxy (entries to its
/// left were written by the client and prove nothing). `None` when the server runs without peer
/// addresses (a router driven in-process).
pub(crate) fn client_address(
    peer: Option<&ConnectInfo<SocketAddr>>,
    headers: &HeaderMap,
    trusted: &[IpNet],
) -> Option<IpAddr> {
    let peer = peer?.0.ip().to_canonical();
    let is_trusted = |ip: &IpAddr| trusted.iter().any(|net| net.contains(ip));
    if !is_trusted(&peer) {
        return Some(peer);
    }
    let forwarded: Vec<IpAddr> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|entry| entry.trim().parse::<IpAddr>().ok())
        .map(|ip| ip.to_canonical())
        .collect();
    Some(forwarded.into_iter().rev().find(|ip| !is_trusted(ip)).unwrap_or(peer))
}

/// The per-pod limits of `[security]`.
pub struct CallerLimits {
    per_key: Option<DefaultKeyedRateLimiter<Arc<str>>>,
    failures: Option<DefaultKeyedRateLimiter<IpAddr>>,
    /// Addresses out of failed attempts, until when.
    refused_until: quick_cache::sync::Cache<IpAddr, Instant>,
}

impl CallerLimits {
    /// The limits `security` configures (a 0 turns one off).
    pub fn new(security: &SecuritySettings) -> CallerLimits {
        let per_key = NonZeroU32::new(security.requests_per_second_per_key)
            .map(|n| DefaultKeyedRateLimiter::keyed(Quota::per_second(n)));
        let failures = NonZeroU32::new(security.failed_auth_per_minute)
            .map(|n| DefaultKeyedRateLimiter::keyed(Quota::per_minute(n)));
        CallerLimits { per_key, failures, refused_until: quick_cache::sync::Cache::new(MAX_TRACKED) }
    }

    /// `Err(wait)` while `address` has used up its failed attempts: it is refused before its
    /// credential is even looked up.
    pub(crate) fn check_address(&self, address: Option<IpAddr>) -> Result<(), Duration> {
        let Some(ip) = address else { return Ok(()) };
        match self.refused_until.get(&ip) {
            Some(until) if until > Instant::now() => Err(until - Instant::now()),
            _ => Ok(()),
        }
    }

    /// Counts a failed authentication from `address`; once over the budget the address is refused
    /// until the budget has room again.
    pub(crate) fn note_failure(&self, address: Option<IpAddr>) {
        let (Some(limiter), Some(ip)) = (&self.failures, address) else { return };
        if let Err(not_until) = limiter.check_key(&ip) {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            self.refused_until.insert(ip, Instant::now() + wait);
            metrics::counter!("cifpool_http_refused_total", "limit" => "failed_auth").increment(1);
            tracing::warn!(client = %ip, ?wait, "too many failed authentications: refusing the address for a while");
        }
        if limiter.len() > MAX_TRACKED {
            limiter.retain_recent();
        }
    }

    /// `Err(wait)` when the key `name` is over its request rate on this pod.
    pub(crate) fn check_key(&self, name: &Arc<str>) -> Result<(), Duration> {
        let Some(limiter) = &self.per_key else { return Ok(()) };
        let checked = limiter.check_key(name);
        if limiter.len() > MAX_TRACKED {
            limiter.retain_recent();
        }
        checked.map_err(|not_until| {
            metrics::counter!("cifpool_http_refused_total", "limit" => "key_rate").increment(1);
            not_until.wait_time_from(DefaultClock::default().now())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(ip: &str) -> ConnectInfo<SocketAddr> {
        ConnectInfo(SocketAddr::new(ip.parse().unwrap(), 40_000))
    }

    #[test]
    fn forwarded_for_counts_only_behind_a_trusted_proxy() {
        let mut headers = HeaderMap::new();
        headers.insert("x-forwarded-for", "6.6.6.6, 203.0.113.9, 10.0.0.7".parse().unwrap());
        let trusted: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
        let from = |ip: &str, trusted: &[IpNet]| client_address(Some(&peer(ip)), &headers, trusted);
        assert_eq!(from("198.51.100.4", &trusted), Some("198.51.100.4".parse().unwrap()), "not a proxy");
        assert_eq!(from("10.1.2.3", &trusted), Some("203.0.113.9".parse().unwrap()), "the proxy's client");
        assert_eq!(from("10.1.2.3", &[]), Some("10.1.2.3".parse().unwrap()), "no proxy is trusted");
        assert_eq!(client_address(None, &headers, &trusted), None);
    }

    #[test]
    fn an_address_out_of_failed_attempts_is_refused_and_a_busy_key_is_slowed() {
        let settings = SecuritySettings {
            requests_per_second_per_key: 2,
            failed_auth_per_minute: 3,
            ..SecuritySettings::default()
        };
        let limits = CallerLimits::new(&settings);
        let (guesser, other) = (Some("192.0.2.1".parse().unwrap()), Some("192.0.2.2".parse().unwrap()));
        for _ in 0..3 {
            limits.note_failure(guesser);
            assert_eq!(limits.check_address(guesser), Ok(()), "within the budget");
        }
        limits.note_failure(guesser);
        let wait = limits.check_address(guesser).unwrap_err();
        assert!(wait > Duration::ZERO && wait <= Duration::from_secs(20), "{wait:?}");
        assert_eq!(limits.check_address(other), Ok(()), "another address is not touched");
        let key: Arc<str> = "web".into();
        assert!(limits.check_key(&key).is_ok() && limits.check_key(&key).is_ok());
        assert!(limits.check_key(&key).is_err(), "the third request within a second");
        assert!(limits.check_key(&"mobile".into()).is_ok(), "per key");
    }
}
