//! The log's format on disk: frames of records, each frame checked against its segment's number.
//!
//! A segment starts with a header, [`MAGIC`] then a salt (u64, little-endian) drawn at random
//! when the segment was created, synced before any frame is written. Then come frames, one
//! per batch the writer synced: the body's length (u32), a CRC-32 of the segment's number and
//! salt (u64 each) followed by the body (u32), both little-endian, then the body: records
//! back to back. A frame with an empty body ends the segment (written and synced before the
//! next segment is created). Segment files are reused, so what follows the last frame
//! written may be zeros or bytes of the file's earlier use (frames, and inside them values
//! a client chose): none of them can pass the check without the new salt, which was never
//! written anywhere but in this header. The header names no version: a file longer than a
//! header whose header is neither this one nor zeros (a crash before it was written) is
//! refused, never read as empty, so a log of another format is not replayed as nothing.

/// A frame's header: the body's length and its checksum.
pub(super) const FRAME_HEADER: usize = 8;

/// What a segment file starts with, before its salt.
const MAGIC: &[u8; 8] = b"fencelog";

/// A segment's header: [`MAGIC`] and the salt.
pub(in crate::disk) const SEGMENT_HEADER: usize = 16;

/// The header of a segment whose frames are checked with `salt`.
pub(in crate::disk) fn header(salt: u64) -> [u8; SEGMENT_HEADER] {
    let mut h = [0; SEGMENT_HEADER];
    h[..8].copy_from_slice(MAGIC);
    h[8..].copy_from_slice(&salt.to_le_bytes());
    h
}

/// One write, as the log records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::disk) enum Op<'a> {
    /// `key` now holds `value` in `tree`.
    Put {
        tree: &'a [u8],
        key: &'a [u8],
        value: &'a [u8],
    },
    /// `key` is gone from `tree`.
    Remove { tree: &'a [u8], key: &'a [u8] },
    /// `tree` is empty.
    Clear { tree: &'a [u8] },
}

const PUT: u8 = 1;
const REMOVE: u8 = 2;
const CLEAR: u8 = 3;

impl Op<'_> {
    /// Appends this record to `buf`: its kind, the tree's name (a length byte: names are at
    /// most 255 bytes, `DurableDb::tree` checks), then the key and value, each after its
    /// length (u32, little-endian).
    pub(in crate::disk) fn encode(&self, buf: &mut Vec<u8>) {
        let (kind, tree, key, value) = match *self {
            Op::Put { tree, key, value } => (PUT, tree, Some(key), Some(value)),
            Op::Remove { tree, key } => (REMOVE, tree, Some(key), None),
            Op::Clear { tree } => (CLEAR, tree, None, None),
        };
        let tree = &tree[..tree.len().min(255)];
        buf.push(kind);
        buf.push(u8::try_from(tree.len()).unwrap_or(u8::MAX));
        buf.extend_from_slice(tree);
        for part in [key, value].into_iter().flatten() {
            buf.extend_from_slice(&len32(part.len()).to_le_bytes());
            buf.extend_from_slice(part);
        }
    }
}

/// A length as the log stores it. sled keeps keys and values far below 4 GiB.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn checksum(segment: u64, salt: u64, body: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&segment.to_le_bytes());
    hasher.update(&salt.to_le_bytes());
    hasher.update(body);
    hasher.finalize()
}

/// Appends one frame holding `body` (a batch of records; empty: the segment's end) for
/// segment `segment` with salt `salt` to `out`.
pub(in crate::disk) fn frame(segment: u64, salt: u64, body: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&len32(body.len()).to_le_bytes());
    out.extend_from_slice(&checksum(segment, salt, body).to_le_bytes());
    out.extend_from_slice(body);
}

/// What a segment's file holds.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Segment<'a> {
    /// The records of every whole frame, in order.
    pub(super) ops: Vec<Op<'a>>,
    /// Where its frames stop.
    pub(super) end: End,
}

/// Where a segment's frames stop.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum End {
    /// At its end frame.
    Ended,
    /// At byte `at`: a frame cut short, or bytes of the file's earlier use.
    Cut { at: usize },
    /// Before any frame: the file is shorter than a header, or its header is zeros (a crash
    /// while it was created; before the last segment, damage).
    NoHeader,
}

/// Why a segment's file is refused: not something a crash does.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Unreadable {
    /// The frame at `at` passed its checksum but its records do not read.
    Undecodable { at: usize },
    /// The frame at `at` fails its checksum, yet a later frame, at `later`, passes it and
    /// starts a chain (see [`later_frame`]): the writer writes a frame only once every
    /// earlier one is synced, so a crash cuts the last frame only, and this is damage to
    /// synced frames.
    Damaged { at: usize, later: usize },
    /// The header is neither this build's nor zeros, and frames may follow it: written by
    /// another format of the log (another version of fence), or damaged.
    Foreign,
}

/// Reads segment `segment` from its file's bytes: frames up to its end, or up to the first
/// frame cut short or left from the file's earlier use. A file without a whole header, or
/// with one of zeros, holds nothing (a crash while it was being created: the header is
/// synced before any frame is written); another header on a longer file is refused.
pub(super) fn read(bytes: &[u8], segment: u64) -> Result<Segment<'_>, Unreadable> {
    let mut ops = Vec::new();
    let salt = match bytes.split_first_chunk::<SEGMENT_HEADER>() {
        Some((h, _)) if h.starts_with(MAGIC) => {
            u64::from_le_bytes(h[8..].try_into().unwrap_or_default())
        }
        Some((h, rest)) if !rest.is_empty() && h.iter().any(|&b| b != 0) => {
            return Err(Unreadable::Foreign);
        }
        _ => {
            return Ok(Segment {
                ops,
                end: End::NoHeader,
            });
        }
    };
    let mut at = SEGMENT_HEADER;
    while let Some(body) = frame_at(bytes, at, segment, salt) {
        if body.is_empty() {
            return Ok(Segment {
                ops,
                end: End::Ended,
            });
        }
        records(body, &mut ops).ok_or(Unreadable::Undecodable { at })?;
        at += FRAME_HEADER + body.len();
    }
    if let Some(later) = later_frame(bytes, at, segment, salt) {
        return Err(Unreadable::Damaged { at, later });
    }
    Ok(Segment {
        ops,
        end: End::Cut { at },
    })
}

fn frame_at(bytes: &[u8], at: usize, segment: u64, salt: u64) -> Option<&[u8]> {
    let (len, crc) = frame_header(bytes, at)?;
    let start = at + FRAME_HEADER;
    let body = bytes.get(start..start.checked_add(len)?)?;
    (checksum(segment, salt, body) == crc).then_some(body)
}

/// The length and checksum of the frame header at `at`, if the file holds one there.
fn frame_header(bytes: &[u8], at: usize) -> Option<(usize, u32)> {
    let header = bytes.get(at..at.checked_add(FRAME_HEADER)?)?;
    let (len, crc) = header.split_first_chunk::<4>()?;
    let len = usize::try_from(u32::from_le_bytes(*len)).ok()?;
    Some((len, u32::from_le_bytes(crc.try_into().ok()?)))
}

/// How much [`later_frame`] may do per byte of the file: offsets tried, records parsed and
/// bytes checksummed, together.
const SCAN_WORK: usize = 8;

/// Where a frame of this segment (number and salt) that passes its checksum, and starts a
/// chain, starts after the one at `at`, which does not: the frame that `at`'s length points
/// past first (damage to a body or a checksum leaves the length right): one frame that
/// passes there is enough. Then every byte after `at`: one checksum alone is 32 bits, and
/// over a reused 16 MiB file of old frames and runs of zeros (an end frame's checksum is the
/// same wherever it is) a stray match would refuse a genuine crash about once in 10^4 to
/// 10^5. So there the frame after the candidate must pass its checksum too (an end frame
/// counts), or the candidate must end exactly at the file's end: a stray match then is about
/// 2^-64. Only bodies that read as records are
/// checksummed (every frame the writer wrote reads), and the work is bounded by the file's
/// size: past it, none is reported (as for a crash).
fn later_frame(bytes: &[u8], at: usize, segment: u64, salt: u64) -> Option<usize> {
    let mut check = Check {
        bytes,
        segment,
        salt,
        end: checksum(segment, salt, &[]),
        budget: bytes
            .len()
            .saturating_mul(SCAN_WORK)
            .saturating_add(1 << 16),
    };
    // Where the damaged frame's own length points, one frame that passes is enough: a chance
    // match at one offset is 2^-32, and the frames a crash could not have left there (the
    // one before the last written, damaged) would otherwise be dropped.
    let declared =
        frame_header(bytes, at).and_then(|(len, _)| (at + FRAME_HEADER).checked_add(len));
    if let Some(from) = declared
        && !matches!(check.at(from)?, Found::None)
    {
        return Some(from);
    }
    for from in at.saturating_add(1)..bytes.len() {
        check.budget = check.budget.checked_sub(1)?;
        if check.starts_chain(from)? {
            return Some(from);
        }
    }
    None
}

/// A frame found at an offset by [`Check::at`].
enum Found {
    /// No frame of this segment passes its checksum there.
    None,
    /// An end frame.
    End,
    /// A frame of records, followed by whatever starts at `next`.
    Frame { next: usize },
}

/// What [`later_frame`] checks offsets of a file against, and the work it has left.
struct Check<'a> {
    bytes: &'a [u8],
    segment: u64,
    salt: u64,
    /// An end frame's checksum.
    end: u32,
    budget: usize,
}

impl Check<'_> {
    /// Whether a frame that passes its checksum starts at `from` and a chain with it: the
    /// frame after it passes its own (an end frame counts), or it ends at the file's end.
    /// `None` once the budget is spent.
    fn starts_chain(&mut self, from: usize) -> Option<bool> {
        let next = match self.at(from)? {
            Found::None => return Some(false),
            // Nothing the writer wrote follows an end frame.
            Found::End => return Some(from + FRAME_HEADER == self.bytes.len()),
            Found::Frame { next } => next,
        };
        if next == self.bytes.len() {
            return Some(true);
        }
        Some(!matches!(self.at(next)?, Found::None))
    }

    /// The frame of this segment that passes its checksum at `from`, if any. `None` once the
    /// budget is spent.
    fn at(&mut self, from: usize) -> Option<Found> {
        let Some((len, crc)) = frame_header(self.bytes, from) else {
            return Some(Found::None);
        };
        if len == 0 {
            return Some(if crc == self.end {
                Found::End
            } else {
                Found::None
            });
        }
        let start = from + FRAME_HEADER;
        let Some(body) = start
            .checked_add(len)
            .and_then(|stop| self.bytes.get(start..stop))
        else {
            return Some(Found::None);
        };
        if !reads(body, &mut self.budget)? {
            return Some(Found::None);
        }
        self.budget = self.budget.checked_sub(len)?;
        Some(if checksum(self.segment, self.salt, body) == crc {
            Found::Frame { next: start + len }
        } else {
            Found::None
        })
    }
}

/// Whether `body` reads as records to its end, each record parsed taken from `budget`;
/// `None` once it is spent.
fn reads(mut body: &[u8], budget: &mut usize) -> Option<bool> {
    while !body.is_empty() {
        *budget = budget.checked_sub(1)?;
        match record(body) {
            Some((_, rest)) => body = rest,
            None => return Some(false),
        }
    }
    Some(true)
}

/// Appends the records of `body` to `ops`; `None` when it does not read to its end.
fn records<'a>(mut body: &'a [u8], ops: &mut Vec<Op<'a>>) -> Option<()> {
    while !body.is_empty() {
        let (op, rest) = record(body)?;
        ops.push(op);
        body = rest;
    }
    Some(())
}

/// The record `body` starts with, and what follows it.
fn record(body: &[u8]) -> Option<(Op<'_>, &[u8])> {
    let (&kind, rest) = body.split_first()?;
    let (&tree_len, rest) = rest.split_first()?;
    let (tree, mut rest) = rest.split_at_checked(usize::from(tree_len))?;
    let mut part = || {
        let (n, tail) = rest.split_first_chunk::<4>()?;
        let n = usize::try_from(u32::from_le_bytes(*n)).ok()?;
        let (part, tail) = tail.split_at_checked(n)?;
        rest = tail;
        Some(part)
    };
    let op = match kind {
        PUT => Op::Put {
            tree,
            key: part()?,
            value: part()?,
        },
        REMOVE => Op::Remove { tree, key: part()? },
        CLEAR => Op::Clear { tree },
        _ => return None,
    };
    Some((op, rest))
}

#[cfg(test)]
mod tests;
