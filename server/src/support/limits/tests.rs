//! Tests of [`super`] (limits.rs).

use super::*;

#[test]
fn buckets_refill_at_their_rate() {
    let m = RateMap::new(10.0, 3.0);
    let t = Instant::now();
    for _ in 0..3 {
        assert!(m.take(1u8, t).is_ok());
    }
    let wait = m.take(1u8, t).unwrap_err();
    assert!((wait.as_secs_f64() - 0.1).abs() < 1e-6, "{wait:?}");
    assert!(m.take(2u8, t).is_ok(), "another key has its own bucket");
    assert!(m.take(1u8, t + Duration::from_millis(100)).is_ok());
    assert!(m.take(1u8, t + Duration::from_millis(100)).is_err());
    // Refills cap at the burst.
    let later = t + Duration::from_secs(60);
    for _ in 0..3 {
        assert!(m.take(1u8, later).is_ok());
    }
    assert!(m.take(1u8, later).is_err());
    let off = RateMap::new(0.0, 0.0);
    for _ in 0..1000 {
        assert!(off.take(1u8, t).is_ok());
    }
}

#[test]
fn the_maps_stay_bounded() {
    let m = RateMap::new(1.0, 1.0);
    let t = Instant::now();
    for k in 0..(MAX_KEYS as u32 + 10) {
        let _ = m.take(k, t);
    }
    assert!(m.buckets.lock().unwrap().len() <= MAX_KEYS);
}

#[test]
fn per_ip_connections_release_on_drop() {
    let l = Limits::new(LimitConfig {
        max_connections_per_ip: 2,
        ..Default::default()
    });
    let ip = IpKey::of("10.0.0.1".parse().unwrap());
    let a = l.connect_ip(ip).unwrap();
    let _b = l.connect_ip(ip).unwrap();
    assert!(l.connect_ip(ip).is_none());
    assert!(l
        .connect_ip(IpKey::of("10.0.0.2".parse().unwrap()))
        .is_some());
    drop(a);
    assert!(l.connect_ip(ip).is_some());
    assert_eq!(l.counts().connections_refused_per_ip, 1);
}

#[tokio::test]
async fn unauthenticated_places_per_ip_prefix_and_pool_go_back_on_authentication() {
    let l = Limits::new(LimitConfig {
        max_connections_per_ip: 2,
        max_connections_per_prefix: 3,
        ..Default::default()
    });
    let total = Arc::new(Semaphore::new(10));
    let pool = Arc::new(Semaphore::new(4));
    let key = |a: &str| IpKey::of(a.parse().unwrap());
    let slot = |ip: &str| {
        let u = l.unauthenticated(Some(&pool), Some(key(ip)))?;
        let t = total.clone().try_acquire_owned().unwrap();
        Ok::<_, Refused>(ConnSlot::new(t, u, l.opened()))
    };
    let a = slot("10.0.0.1").unwrap();
    let _b = slot("10.0.0.1").unwrap();
    assert_eq!(slot("10.0.0.1").unwrap_err(), Refused::PerIp);
    let _c = slot("10.0.0.2").unwrap();
    // 10.0.0.0/24 holds 3: another address in it is refused, another /24 is not.
    assert_eq!(slot("10.0.0.3").unwrap_err(), Refused::PerPrefix);
    let _d = slot("10.0.1.3").unwrap();
    // The pool of 4 is full.
    assert_eq!(slot("10.9.0.1").unwrap_err(), Refused::Pool);
    assert_eq!(l.counts().connections_unauthenticated, 4);
    // `a` authenticates: its IP, prefix and pool places go back, its total slot stays.
    a.authenticated();
    assert!(!a.is_unauthenticated());
    a.authenticated();
    assert_eq!(total.available_permits(), 6);
    assert_eq!(pool.available_permits(), 1);
    let _e = slot("10.0.0.3").unwrap();
    let c = l.counts();
    assert_eq!(c.connections_authenticated, 1);
    assert_eq!(c.connections_open, 5);
    assert_eq!(c.connections_unauthenticated, 4);
    assert_eq!(
        (
            c.connections_refused_per_ip,
            c.connections_refused_per_prefix,
            c.connections_refused_unauthenticated
        ),
        (1, 1, 1)
    );
    // A refusal holds nothing: the per-IP place taken before the prefix refused is back.
    assert_eq!(l.per_ip.get(key("10.0.0.3")), 1);
    drop(a);
    assert_eq!(total.available_permits(), 6);
    assert_eq!(l.counts().connections_open, 4);
}

#[test]
fn the_pool_defaults_to_three_quarters_of_the_total() {
    let d = LimitConfig::default();
    assert_eq!(d.max_connections_per_prefix, 512);
    assert_eq!(d.unauthenticated_pool(4096), 3072);
    assert_eq!(d.unauthenticated_pool(4), 3);
    assert_eq!(d.unauthenticated_pool(1), 1);
    let set = LimitConfig {
        max_unauthenticated: Some(9000),
        ..d
    };
    assert_eq!(set.unauthenticated_pool(4096), 4096);
}

#[test]
fn prefixes() {
    let p = |a: &str| PrefixKey::of(a.parse().unwrap()).to_string();
    assert_eq!(p("127.0.0.18"), "127.0.0.0/24");
    assert_eq!(p("::ffff:10.1.2.3"), "10.1.2.0/24");
    assert_eq!(p("2001:db8:1:2:aaaa::1"), "2001:db8:1::/48");
    assert_eq!(
        PrefixKey::of("2001:db8:1:ffff::1".parse().unwrap()),
        PrefixKey::of("2001:db8:1:2::9".parse().unwrap())
    );
    assert_ne!(
        PrefixKey::of("127.0.0.1".parse().unwrap()),
        PrefixKey::of("127.1.0.1".parse().unwrap())
    );
}

#[test]
fn client_ips() {
    let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let mut h = axum::http::HeaderMap::new();
    h.append("x-forwarded-for", "1.2.3.4, 5.6.7.8".parse().unwrap());
    assert_eq!(client_ip(&h, peer, false).to_string(), "127.0.0.1");
    assert_eq!(client_ip(&h, peer, true).to_string(), "5.6.7.8");
    h.append("x-forwarded-for", "junk".parse().unwrap());
    assert_eq!(client_ip(&h, peer, true).to_string(), "5.6.7.8");
    assert_eq!(
        client_ip(&axum::http::HeaderMap::new(), peer, true).to_string(),
        "127.0.0.1"
    );
    let a = IpKey::of("2001:db8:1:2:aaaa::1".parse().unwrap());
    let b = IpKey::of("2001:db8:1:2:bbbb::7".parse().unwrap());
    assert_eq!(a, b);
    assert_eq!(a.to_string(), "2001:db8:1:2::/64");
    assert_eq!(
        IpKey::of("::ffff:10.1.2.3".parse().unwrap()).to_string(),
        "10.1.2.3"
    );
}

#[test]
fn flags_check() {
    let d = LimitConfig::default();
    assert_eq!(d.hello_timeout, Duration::from_secs(10));
    assert!(!d.trust_proxy);
    use clap::Parser;
    #[derive(Parser)]
    struct P {
        #[command(flatten)]
        a: LimitArgs,
    }
    for bad in [
        &["--push-rate", "-1"][..],
        &["--push-rate-per-ip", "inf"],
        &["--idle-timeout", "0"],
        &["--hello-timeout", "nan"],
        &["--max-unauthenticated", "0"],
    ] {
        let p = P::try_parse_from(std::iter::once("serve").chain(bad.iter().copied()));
        assert!(p.map_or(true, |p| p.a.check().is_err()), "{bad:?}");
    }
}
