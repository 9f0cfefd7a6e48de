//! How the group's lane budget and this relay's owned key partitions are split among the
//! claim loops.

/// How many claim loops each of `live` relays runs: the group's budget of `lanes`, split evenly
/// and rounded up, at least one. The database then sees about the same number of concurrent
/// claims whether one relay runs or four; adding relays adds standbys and spreads the relays'
/// own work, without multiplying the claims that compete in PostgreSQL.
pub(super) fn lanes_per_relay(lanes: usize, live: usize) -> usize {
    lanes.max(1).div_ceil(live.max(1))
}

/// The owned key partitions (sorted) of claim loop `lane` out of `lanes`: a contiguous run of
/// the owned list, so that with contiguous ownership ([`crate::lease::share`]) each claim's
/// partitions form one narrow range that the index can check.
pub(super) fn lane_share(owned: &[i16], lanes: usize, lane: usize) -> Vec<i16> {
    let lanes = lanes.max(1);
    let n = owned.len();
    owned[lane * n / lanes..(lane + 1) * n / lanes].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lane_budget_is_split_among_live_relays() {
        // One relay runs them all; more relays share them, rounded up, never fewer than one
        // each, so the group never runs fewer lanes than configured.
        assert_eq!(lanes_per_relay(4, 1), 4);
        assert_eq!(lanes_per_relay(4, 2), 2);
        assert_eq!(lanes_per_relay(4, 3), 2);
        assert_eq!(lanes_per_relay(4, 4), 1);
        assert_eq!(lanes_per_relay(4, 9), 1);
        assert_eq!(lanes_per_relay(1, 0), 1);
        for live in 1..=10 {
            assert!(lanes_per_relay(4, live) * live >= 4);
        }
    }

    #[test]
    fn lanes_split_the_owned_partitions_into_contiguous_runs() {
        let owned: Vec<i16> = (64..128).collect();
        let a = lane_share(&owned, 2, 0);
        let b = lane_share(&owned, 2, 1);
        assert_eq!(a, (64..96).collect::<Vec<_>>());
        assert_eq!(b, (96..128).collect::<Vec<_>>());
        // Uneven splits still cover everything once; more lanes than partitions leave some
        // lanes without any.
        let owned: Vec<i16> = vec![3, 4, 5, 9, 10];
        let parts: Vec<Vec<i16>> = (0..3).map(|l| lane_share(&owned, 3, l)).collect();
        assert_eq!(parts.concat(), owned);
        let parts: Vec<Vec<i16>> = (0..8).map(|l| lane_share(&owned, 8, l)).collect();
        assert_eq!(parts.concat(), owned);
        assert!(parts.iter().any(Vec::is_empty));
        assert!(lane_share(&[], 2, 1).is_empty());
    }
}
