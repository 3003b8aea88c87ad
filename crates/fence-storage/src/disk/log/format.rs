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
    /// The frame at `at` fails its checksum, yet a later frame, at `later`, passes it: the
    /// writer writes a frame only once every earlier one is synced, so a crash cuts the last
    /// frame only, and this is damage to synced frames.
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

/// Where a frame of this segment (number and salt) that passes its checksum starts after
/// the one at `at`, which does not: the frame that `at`'s length points past first (damage
/// to a body or a checksum leaves the length right), then every byte after `at`. Only
/// bodies that read as records are checksummed (every frame the writer wrote reads), and
/// the work is bounded by the file's size: past it, none is reported (as for a crash).
fn later_frame(bytes: &[u8], at: usize, segment: u64, salt: u64) -> Option<usize> {
    let end = checksum(segment, salt, &[]);
    let mut budget = bytes
        .len()
        .saturating_mul(SCAN_WORK)
        .saturating_add(1 << 16);
    let declared =
        frame_header(bytes, at).and_then(|(len, _)| (at + FRAME_HEADER).checked_add(len));
    for from in declared
        .into_iter()
        .chain(at.saturating_add(1)..bytes.len())
    {
        budget = budget.checked_sub(1)?;
        let Some((len, crc)) = frame_header(bytes, from) else {
            continue;
        };
        if len == 0 {
            // An end frame: its checksum is the same wherever it is.
            if crc == end {
                return Some(from);
            }
            continue;
        }
        let start = from + FRAME_HEADER;
        let Some(body) = start
            .checked_add(len)
            .and_then(|stop| bytes.get(start..stop))
        else {
            continue;
        };
        if !reads(body, &mut budget)? {
            continue;
        }
        budget = budget.checked_sub(len)?;
        if checksum(segment, salt, body) == crc {
            return Some(from);
        }
    }
    None
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
mod tests {
    use super::*;

    const OPS: [Op<'static>; 4] = [
        Op::Put {
            tree: b"leases",
            key: b"job-1",
            value: &[7; 300],
        },
        Op::Remove {
            tree: b"leases",
            key: b"",
        },
        Op::Clear { tree: b"stamps" },
        Op::Put {
            tree: b"",
            key: b"k",
            value: b"",
        },
    ];

    const SALT: u64 = 0x5eed;

    /// Segment 5's file: OPS in two frames (two batches), then its end if `end`; and where
    /// the second frame starts.
    fn file(end: bool) -> (Vec<u8>, usize) {
        let mut out = header(SALT).to_vec();
        let mut second = 0;
        for batch in [&OPS[..3], &OPS[3..]] {
            second = out.len();
            let mut body = Vec::new();
            batch.iter().for_each(|op| op.encode(&mut body));
            frame(5, SALT, &body, &mut out);
        }
        if end {
            frame(5, SALT, &[], &mut out);
        }
        (out, second)
    }

    #[test]
    fn frames_read_back_as_written_up_to_the_end_of_the_segment() {
        let (mut bytes, _) = file(true);
        // What follows the end (the file's earlier use) is not read.
        frame(5, SALT, &[9, 9, 9], &mut bytes);
        assert_eq!(
            read(&bytes, 5),
            Ok(Segment {
                ops: OPS.to_vec(),
                end: End::Ended
            })
        );
    }

    #[test]
    fn reading_stops_at_a_cut_a_damaged_byte_zeros_or_another_segments_frame() {
        let (bytes, first) = file(false);
        for cut in first..bytes.len() {
            let got = read(&bytes[..cut], 5).unwrap();
            assert_eq!(got.ops, OPS[..3].to_vec(), "cut at {cut}");
            assert_eq!(got.end, End::Cut { at: first });
        }
        for at in (MAGIC.len()..SEGMENT_HEADER).chain(first..bytes.len()) {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x10;
            let got = read(&damaged, 5).unwrap_or_else(|e| panic!("at {at}: {e:?}"));
            // The header's salt is checked through every frame.
            let expected = if at < first { 0 } else { 3 };
            assert_eq!(got.ops, OPS[..expected].to_vec(), "damaged at {at}");
        }
        let mut zeros = bytes.clone();
        zeros.extend_from_slice(&[0; 64]);
        assert_eq!(read(&zeros, 5).unwrap().ops, OPS.to_vec());
        assert_eq!(
            read(&bytes, 4).unwrap().ops,
            [],
            "a frame written for another segment (the file's earlier use) is not read"
        );
        let mut resalted = bytes.clone();
        resalted[..SEGMENT_HEADER].copy_from_slice(&header(SALT + 1));
        assert_eq!(
            read(&resalted, 5).unwrap().ops,
            [],
            "a frame written under another salt (the same number in another file) is not read"
        );
        assert_eq!(read(&bytes[..SEGMENT_HEADER - 1], 5).unwrap().ops, []);
    }

    /// A header that is neither this build's nor zeros, with frames after it: a log of
    /// another format (a future or older fence) or damage; read as empty, its segment would
    /// be replayed as nothing and deleted. A file that is only a header, or shorter, or one
    /// whose header is zeros, is one a crash left while it was created: empty.
    #[test]
    fn a_header_of_another_format_is_refused_and_one_of_zeros_is_empty() {
        let (bytes, _) = file(true);
        for at in 0..MAGIC.len() {
            let mut other = bytes.clone();
            other[at] ^= 0x01;
            assert_eq!(read(&other, 5), Err(Unreadable::Foreign), "changed at {at}");
            assert_eq!(
                read(&other[..SEGMENT_HEADER], 5).unwrap().end,
                End::NoHeader
            );
            assert_eq!(read(&other[..at + 1], 5).unwrap().end, End::NoHeader);
        }
        let mut zeros = bytes.clone();
        zeros[..SEGMENT_HEADER].fill(0);
        assert_eq!(
            read(&zeros, 5),
            Ok(Segment {
                ops: Vec::new(),
                end: End::NoHeader
            })
        );
        assert_eq!(read(&[0; 1 << 12], 5).unwrap().end, End::NoHeader);
    }

    #[test]
    fn a_frame_that_passes_its_checksum_but_does_not_read_is_refused() {
        let mut bytes = header(SALT).to_vec();
        frame(1, SALT, &[PUT, 200], &mut bytes);
        assert_eq!(
            read(&bytes, 1),
            Err(Unreadable::Undecodable { at: SEGMENT_HEADER })
        );
    }

    /// A crash cuts only the last frame (the writer writes a frame once every earlier one
    /// is synced): a frame that fails its checksum with a good one after it is damage to
    /// synced frames, whose records would be dropped. Wherever the damage is in the frame
    /// (its length too), the later frame is found.
    #[test]
    fn a_damaged_frame_with_a_good_one_after_it_is_refused() {
        let (mut bytes, second) = file(false);
        let third = bytes.len();
        frame(5, SALT, &[], &mut bytes);
        for at in SEGMENT_HEADER..third {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x10;
            let want = if at < second {
                Unreadable::Damaged {
                    at: SEGMENT_HEADER,
                    later: second,
                }
            } else {
                Unreadable::Damaged {
                    at: second,
                    later: third,
                }
            };
            assert_eq!(read(&damaged, 5), Err(want), "damaged at {at}");
        }
    }

    /// What follows a frame a crash cut short in a reused file (frames of its earlier use,
    /// under another segment's number and salt, then the zeros it was filled with) holds no
    /// frame of this segment: read as a crash, not as damage.
    #[test]
    fn a_cut_frame_in_a_reused_file_is_a_crash() {
        let (old, _) = file(true);
        let mut bytes = header(SALT + 1).to_vec();
        let mut body = Vec::new();
        OPS.iter().for_each(|op| op.encode(&mut body));
        frame(6, SALT + 1, &body, &mut bytes);
        let cut = bytes.len() - 3;
        bytes.truncate(cut);
        bytes.extend_from_slice(&old[SEGMENT_HEADER..]);
        bytes.extend_from_slice(&old[SEGMENT_HEADER..]);
        bytes.extend_from_slice(&[0; 4096]);
        assert_eq!(
            read(&bytes, 6),
            Ok(Segment {
                ops: Vec::new(),
                end: End::Cut { at: SEGMENT_HEADER }
            })
        );
    }

    /// A file whose bytes after a bad frame read as records at every offset: the search for
    /// a later frame stops within its bound.
    #[test]
    fn the_search_for_a_later_frame_is_bounded() {
        let mut bytes = header(SALT).to_vec();
        // Frame headers claiming 1 MiB bodies of empty Clear records, at every even offset.
        bytes.extend((0..1 << 20).flat_map(|_| [CLEAR, 0]));
        bytes[SEGMENT_HEADER..SEGMENT_HEADER + 4].copy_from_slice(&(1u32 << 19).to_le_bytes());
        let started = std::time::Instant::now();
        assert_eq!(
            read(&bytes, 5).unwrap().end,
            End::Cut { at: SEGMENT_HEADER }
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn any_bytes_read_without_panicking() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        for len in 0..3_000 {
            let mut bytes: Vec<u8> = (0..len % 97)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            // Half of them in a frame that passes its check, so the records are read too.
            if len % 2 == 0 {
                let body = std::mem::take(&mut bytes);
                bytes.extend_from_slice(&header(SALT));
                frame(3, SALT, &body, &mut bytes);
            }
            let _ = read(&bytes, 3);
        }
    }
}
