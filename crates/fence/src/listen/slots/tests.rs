//! Tests of the slots: who holds a listener's connections, and which to close for room.
use super::*;

fn seat(slots: &Arc<Slots>, peer: &str) -> Option<Seat> {
    let permit = slots.permits().clone().try_acquire_owned().ok()?;
    slots.seat(peer.parse().unwrap(), permit)
}

/// A connection's seat is given back once it closed and every share in it is gone (a
/// request going on upstream after its client left), not before: it holds its slot and
/// its place in its peer's count, and is no idle connection to close for room.
/// A connection picked for room that closed while a request of it goes on upstream keeps its
/// seat, and so counts for its peer again and is no room on its way: its peer cannot open
/// more connections by having them picked, and newcomers are not kept waiting for room that
/// comes only when that request ends.
#[tokio::test]
async fn a_picked_connection_that_closed_with_a_share_still_counts_for_its_peer() {
    let slots = Slots::new(10, 1);
    let peer: IpAddr = "127.0.0.2".parse().unwrap();
    let seated = SeatHold::new(seat(&slots, "127.0.0.2").unwrap());
    let share = seated.clone();
    assert!(slots.evict_for_room(peer, 1), "the idle one is picked");
    assert_eq!(slots.leaving(), 1);
    seated.closed();
    assert_eq!(slots.leaving(), 0, "counted as room on its way");
    assert!(!slots.could_seat(peer), "its peer is at its cap again");
    assert!(
        seat(&slots, "127.0.0.2").is_none(),
        "a second seat for the peer"
    );
    drop(share);
    assert!(slots.could_seat(peer));
}

#[tokio::test]
async fn a_seat_is_kept_while_a_share_in_it_lives() {
    let slots = Slots::new(2, 1);
    let seated = SeatHold::new(seat(&slots, "127.0.0.2").unwrap());
    let share = seated.clone();
    seated.closed();
    let peer: IpAddr = "127.0.0.2".parse().unwrap();
    assert_eq!(
        slots.held_by(peer),
        1,
        "its peer's place given back too early"
    );
    assert_eq!(
        slots.permits().available_permits(),
        1,
        "its slot given back too early"
    );
    assert!(
        !slots.could_seat(peer),
        "a peer at its cap, its connection going on"
    );
    assert!(
        !slots.evict_for_room(peer, 1),
        "picked for room, though gone"
    );
    drop(share);
    assert_eq!(slots.held_by(peer), 0);
    assert_eq!(slots.permits().available_permits(), 2);
}

#[tokio::test]
async fn a_peer_at_its_cap_gives_up_its_own_idle_connection_or_its_newcomer() {
    let slots = Slots::new(10, 2);
    let a = seat(&slots, "127.0.0.2").unwrap();
    let b = seat(&slots, "127.0.0.2").unwrap();
    a.conn.begin(); // busy
    // The third takes the place of b, the idle one, which is asked to close.
    let c = seat(&slots, "127.0.0.2").unwrap();
    assert!(b.conn.evicted.load(Ordering::Acquire));
    assert!(!a.conn.evicted.load(Ordering::Acquire));
    drop(b);
    c.conn.begin();
    // Now both are busy: the newcomer is refused; another peer is not affected.
    assert!(seat(&slots, "127.0.0.2").is_none());
    assert!(seat(&slots, "127.0.0.1").is_some());
    assert_eq!(slots.held_by("127.0.0.2".parse().unwrap()), 2);
}

/// A connection picked for room counts as room on its way until it closes, or until a
/// request begins on it (its close then waits for that request): newcomers waiting for
/// room are not left waiting on it.
#[tokio::test]
async fn room_on_its_way_is_counted_once_and_not_for_a_connection_that_got_busy() {
    let slots = Slots::new(10, 10);
    let (a, b) = (
        seat(&slots, "127.0.0.2").unwrap(),
        seat(&slots, "127.0.0.2").unwrap(),
    );
    assert!(slots.evict_for_room(elsewhere(), 0));
    assert!(slots.evict_for_room(elsewhere(), 0));
    assert_eq!(slots.leaving(), 2);
    a.conn.begin(); // a request arrived as it was picked
    assert_eq!(slots.leaving(), 1);
    drop(a);
    assert_eq!(slots.leaving(), 1);
    drop(b);
    assert_eq!(slots.leaving(), 0);
}

#[tokio::test]
async fn room_is_made_from_the_heaviest_peer_unauthenticated_first() {
    let slots = Slots::new(10, 10);
    let worker = seat(&slots, "127.0.0.1").unwrap();
    worker.conn.begin();
    worker.conn.done(true); // idle, authenticated
    let lone = seat(&slots, "127.0.0.3").unwrap(); // idle, 1 held
    let flood: Vec<Seat> = (0..3).map(|_| seat(&slots, "127.0.0.2").unwrap()).collect();
    flood[0].conn.begin(); // busy: never picked
    flood[1].conn.begin();
    flood[1].conn.done(true); // authenticated
    assert!(slots.evict_for_room(elsewhere(), 0));
    assert!(
        flood[2].conn.evicted.load(Ordering::Acquire),
        "the heaviest peer's idle, unauthenticated one"
    );
    assert!(slots.evict_for_room(elsewhere(), 0));
    assert!(
        lone.conn.evicted.load(Ordering::Acquire),
        "then unauthenticated ones of lighter peers"
    );
    assert!(slots.evict_for_room(elsewhere(), 0));
    assert!(
        flood[1].conn.evicted.load(Ordering::Acquire),
        "then authenticated ones, heaviest first"
    );
    assert!(slots.evict_for_room(elsewhere(), 0));
    assert!(worker.conn.evicted.load(Ordering::Acquire));
    assert!(
        !slots.evict_for_room(elsewhere(), 0),
        "only a busy one is left"
    );
    assert!(!flood[0].conn.evicted.load(Ordering::Acquire));
}

/// A newcomer's address that holds no connection.
fn elsewhere() -> IpAddr {
    "127.0.0.9".parse().unwrap()
}

/// Room for a newcomer is made only from its own peer or from one holding more than it
/// will: a CI run saw the connection of 127.0.0.1 (one held, just seated, its request
/// not yet read) closed for a flood's newcomers.
#[tokio::test]
async fn room_is_never_made_from_a_peer_that_would_then_hold_less() {
    let slots = Slots::new(10, 10);
    let light = seat(&slots, "127.0.0.1").unwrap(); // idle, 1 held
    let flood: Vec<Seat> = (0..3).map(|_| seat(&slots, "127.0.0.2").unwrap()).collect();
    for seat in &flood {
        seat.conn.begin();
    }
    let flooder = "127.0.0.2".parse().unwrap();
    assert!(!slots.evict_for_room(flooder, 3), "nothing of its own idle");
    assert!(
        !slots.evict_for_room(elsewhere(), 1),
        "a newcomer that will hold one takes nothing from a peer holding one"
    );
    assert!(!light.conn.evicted.load(Ordering::Acquire));
    assert!(slots.evict_for_room(elsewhere(), 0));
    assert!(light.conn.evicted.load(Ordering::Acquire));
}

/// Connections already asked to close do not count: the second of two newcomers from a
/// peer holding none (it will hold one) takes nothing from a peer whose two idle
/// connections are down to one staying.
#[tokio::test]
async fn a_peer_is_not_drained_below_the_newcomers_it_makes_room_for() {
    let slots = Slots::new(10, 10);
    let light: Vec<Seat> = (0..2).map(|_| seat(&slots, "127.0.0.1").unwrap()).collect();
    assert!(slots.evict_for_room(elsewhere(), 0));
    assert!(
        !slots.evict_for_room(elsewhere(), 1),
        "one of its two already leaves: 1 is not more than 1"
    );
    let evicted = light
        .iter()
        .filter(|s| s.conn.evicted.load(Ordering::Acquire))
        .count();
    assert_eq!(evicted, 1);
}

/// An IPv4-mapped IPv6 address counts as its IPv4 address (until this version a dual-stack
/// listener counted an IPv4 client twice over); IPv6 addresses count one by one, also within
/// a /64, which may be a whole cloud subnet.
#[tokio::test]
async fn a_mapped_ipv4_address_is_its_ipv4_peer_and_ipv6_addresses_count_apart() {
    let slots = Slots::new(10, 2);
    let _v4 = seat(&slots, "192.0.2.7").unwrap();
    let _mapped = seat(&slots, "::ffff:192.0.2.7").unwrap();
    for seat in [&_v4, &_mapped] {
        seat.conn.begin(); // busy: no room to make among them
    }
    assert_eq!(slots.held_by("192.0.2.7".parse().unwrap()), 2);
    assert!(seat(&slots, "::ffff:192.0.2.7").is_none(), "mapped is IPv4");
    let _a = seat(&slots, "2001:db8:0:1::1").unwrap();
    let _b = seat(&slots, "2001:db8:0:1::2").unwrap();
    for seat in [&_a, &_b] {
        seat.conn.begin();
    }
    assert!(
        seat(&slots, "2001:db8:0:1:ffff::3").is_some(),
        "a host of the same subnet"
    );
}
