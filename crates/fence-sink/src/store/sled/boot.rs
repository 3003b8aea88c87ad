//! The clocks at each open, for telling a step of the wall clock from time passed.
//!
//! Stamps are wall-clock times, the only clock two processes share. A process restarted
//! after the wall clock stepped forward (NTP setting a late clock right, a VM resumed) saw an
//! earlier process's stamps as older by the step: a job busy at a crash looked idle, its
//! restart wait was cut short, and a newer token passed while the dead process's request
//! could still commit (an audit, with a clock stepped an hour forward across a `kill -9`:
//! the newer holder's effect committed 14 s before the old one). So each open records its
//! wall clock beside the time since the machine booted ([`Clock::since_boot`]); the next open
//! on the same boot compares the two clocks' progress, and when the wall clock ran ahead by a
//! step, every job's stamp is taken as of that open ([`restamp`]): each waits the restart
//! hold as a job busy at the crash, and is forgotten only once idle from then. A reboot in
//! between, or a clock that cannot read its boot, is not compared (docs/protocol.md,
//! section 3).
//!
//! [`Clock::since_boot`]: fence_storage::clock::Clock::since_boot

use fence_storage::{clock::BootReading, disk::Tree};

/// The `format` key of the last open's readings: boot id (16 bytes), ms since that boot, wall
/// clock ms (8 bytes each, big-endian).
const OPENED_KEY: &[u8] = b"opened";

/// How far the wall clock may run ahead of the boot clock between two opens and not count as
/// a step, whatever the time between: Linux slews both together (`clock_gettime(2)`), so they
/// part only by steps (and `/proc/uptime`'s hundredths). A review found the first version's
/// tolerance of a thousandth of the time between letting a step of 590 s after 7 days pass
/// unseen.
const TOLERANCE_MS: u64 = 2_000;

/// What the last open's record says of the wall clock since it.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Since {
    /// It stepped forward this far (by more than the tolerance).
    Stepped(u64),
    /// It did not.
    Steady,
    /// It cannot be told: no record, another boot, no reading of this one. Stamps are taken
    /// as they are.
    Unknown(&'static str),
    /// The record is there and cannot be read: taken as a step (the safe side).
    Damaged,
}

/// What happened to the wall clock (`wall_ms` now) since the open recorded in `format`.
pub(super) fn since_last_open(format: &Tree, now: Option<BootReading>, wall_ms: u64) -> Since {
    let raw = match format.get(OPENED_KEY) {
        Ok(Some(raw)) => raw,
        Ok(None) => return Since::Unknown("no earlier open recorded"),
        Err(_) => return Since::Damaged,
    };
    let Some(now) = now else {
        return Since::Unknown("the time since the machine booted cannot be read");
    };
    let Some((boot, boot_ms, then_wall_ms)) = decode(&raw) else {
        return Since::Damaged;
    };
    if boot != now.boot {
        return Since::Unknown("the last open was on another boot");
    }
    let Some(passed) = now.ms.checked_sub(boot_ms) else {
        // The same boot, yet less time since it than at the last open: not a reading of
        // the machine's boot (a container's own uptime, say) to go by.
        return Since::Unknown("the time since boot went back since the last open");
    };
    let step = wall_ms.saturating_sub(then_wall_ms).saturating_sub(passed);
    if step > TOLERANCE_MS {
        Since::Stepped(step)
    } else {
        Since::Steady
    }
}

fn decode(raw: &[u8]) -> Option<(u128, u64, u64)> {
    let (boot, rest) = raw.split_first_chunk::<16>()?;
    let (boot_ms, rest) = rest.split_first_chunk::<8>()?;
    let (wall_ms, _) = rest.split_first_chunk::<8>()?;
    Some((
        u128::from_be_bytes(*boot),
        u64::from_be_bytes(*boot_ms),
        u64::from_be_bytes(*wall_ms),
    ))
}

/// Records this open's readings for the next, its wall clock `wall_ms` lowered by how far it
/// has since run behind the time since the open (`lowest_offset_ms`, 0 or less: a step back
/// while it ran, whose stamps a later forward step would otherwise age unseen, as the two
/// net out between the opens). Nothing when the clock cannot read its boot: the record of an
/// earlier open then stays, and the next open compares with that.
pub(super) fn record_open(
    format: &Tree,
    now: Option<BootReading>,
    wall_ms: u64,
    lowest_offset_ms: i64,
) -> sled::Result<()> {
    let Some(now) = now else {
        return Ok(());
    };
    let wall_ms = wall_ms.saturating_add_signed(lowest_offset_ms.min(0));
    let mut v = [0u8; 32];
    v[..16].copy_from_slice(&now.boot.to_be_bytes());
    v[16..24].copy_from_slice(&now.ms.to_be_bytes());
    v[24..].copy_from_slice(&wall_ms.to_be_bytes());
    format.insert(OPENED_KEY, &v[..]).map(|_| ())
}

/// Takes every job of `generations` as stamped at `stamp_ms` (this open plus the stamp
/// ahead), and as raised at `opened_ms` where a raise was kept: none of their earlier
/// stamps can be trusted after a step, while every earlier process had ended by this open.
/// Answers how many jobs it wrote; the caller rebuilds the `stamps` index from them.
pub(super) fn restamp(generations: &Tree, opened_ms: u64, stamp_ms: u64) -> sled::Result<usize> {
    let mut n = 0;
    for item in generations.iter() {
        let (job, value) = item?;
        let word = |i: usize| {
            value
                .get(i * 8..i * 8 + 8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map(u64::from_be_bytes)
        };
        let (Some(generation), Some(touched)) = (word(0), word(1)) else {
            continue; // damage: reported when the job is loaded
        };
        // A 16-byte record counts its stamp as its raise (see `decode_generation`); one of
        // another length is damage, reported when its job is loaded, and left as it is.
        let raised = match value.len() {
            24 => word(2),
            16 => Some(touched),
            _ => None,
        };
        let Some(raised) = raised else { continue };
        let raised = if raised == 0 {
            0
        } else {
            raised.max(opened_ms)
        };
        let mut new = [0u8; 24];
        new[..8].copy_from_slice(&generation.to_be_bytes());
        new[8..16].copy_from_slice(&touched.max(stamp_ms).to_be_bytes());
        new[16..].copy_from_slice(&raised.to_be_bytes());
        generations.insert(&job, &new[..])?;
        n += 1;
    }
    Ok(n)
}

impl super::SledStore {
    /// At the open (`now`, the boot reading taken beside the wall clock's `opened_ms`): when
    /// the wall clock stepped forward since the last open on this boot, takes every job as
    /// stamped now and makes that durable, then records this open for the next one (the
    /// order matters: a crash between leaves the earlier record, and the next open restamps
    /// again).
    pub(super) fn restamp_after_a_step(
        &self,
        now: Option<BootReading>,
        path: &std::path::Path,
    ) -> Result<(), fence_storage::disk::OpenError> {
        let failed = |e: String| fence_storage::disk::OpenError::Record {
            path: path.to_owned(),
            record: "opened",
            reason: format!(
                "taking every job as stamped at this open, after a step of the wall clock since the last one, failed: {e}"
            ),
        };
        let since = since_last_open(&self.format, now, self.opened_ms);
        if let Since::Unknown(why) = since {
            tracing::debug!(
                why,
                "a step of the wall clock since the last open of the data directory cannot be told from time passed"
            );
        }
        let step = match since {
            Since::Stepped(step) => Some(step),
            Since::Damaged => Some(0),
            Since::Steady | Since::Unknown(_) => None,
        };
        if let Some(step) = step {
            let stamp_ms = self.opened_ms.saturating_add(crate::store::STAMP_AHEAD_MS);
            let jobs = restamp(&self.generations, self.opened_ms, stamp_ms)
                .map_err(|e| failed(e.to_string()))?;
            // The index is rebuilt from the restamped jobs (`repair_stamps`, next).
            self.format
                .remove(super::STAMPS_KEY)
                .map_err(|e| failed(e.to_string()))?;
            self.db.flush_now().map_err(|e| failed(e.to_string()))?;
            tracing::warn!(
                step_ms = step,
                jobs,
                "the wall clock stepped forward since the last open of this data directory on this boot (0: its record of that open could not be read): every job is taken as stamped now, so a newer token waits the restart hold and no job is forgotten before it has been idle since now"
            );
        }
        record_open(&self.format, now, self.opened_ms, 0).map_err(|e| failed(e.to_string()))
    }

    /// After the wall clock was seen running further behind the time since the open than
    /// ever (`lowest_offset_ms`, below 0: a step back), records the open again lowered by it,
    /// so that the next open sees a later forward step that nets it out. Written before the
    /// stamp under the new offset, in the same log: never on disk after it.
    pub(super) fn lower_open_record(&self, lowest_offset_ms: i64) {
        if let Err(e) = record_open(
            &self.format,
            self.opened_boot,
            self.opened_ms,
            lowest_offset_ms,
        ) {
            tracing::warn!(error = %e, "cannot record how far the wall clock stepped back since the open; a later step forward across a restart may go unseen");
        }
    }
}
