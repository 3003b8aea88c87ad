//! Tests of the log's format: frames read back, cuts, damage and foreign headers.

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

/// One checksum that matches by chance after a frame a crash cut short, in a reused
/// file, is not damage: an end frame's checksum is the same wherever it is, so a run of
/// four zeros followed by those four bytes (the file's earlier use) passes it, as may
/// a stray frame of records. A later frame counts only if the frame after it passes its
/// checksum too (an end frame counts), or it ends where the file does.
#[test]
fn one_checksum_matched_by_chance_after_a_cut_frame_is_a_crash() {
    let (whole, second) = file(false);
    let end = checksum(5, SALT, &[]).to_le_bytes();
    // The second frame cut short, then old bytes: a stray end frame among others.
    let torn = || [&whole[..second + FRAME_HEADER + 1], &[0xaa; 16]].concat();
    let mut bytes = torn();
    let stray = bytes.len();
    bytes.extend_from_slice(&[0, 0, 0, 0]);
    bytes.extend_from_slice(&end);
    bytes.extend_from_slice(&[0; 64]);
    let cut = Ok(Segment {
        ops: OPS[..3].to_vec(),
        end: End::Cut { at: second },
    });
    assert_eq!(read(&bytes, 5), cut, "a stray end frame");
    // The same at the file's end is the segment's end frame after a damaged one.
    bytes.truncate(stray + FRAME_HEADER);
    assert_eq!(
        read(&bytes, 5),
        Err(Unreadable::Damaged {
            at: second,
            later: stray
        })
    );
    // A stray frame of records, followed by zeros: no chain.
    let mut bytes = torn();
    let stray = bytes.len();
    frame(5, SALT, &whole[second + FRAME_HEADER..], &mut bytes);
    let after = bytes.len();
    bytes.extend_from_slice(&[0; 64]);
    assert_eq!(read(&bytes, 5), cut, "a stray frame of records");
    // Followed by a frame that passes too (or an end frame), or at the file's end: found.
    for tail in [&whole[second..], &end_frame()[..], &[]] {
        let mut chained = bytes[..after].to_vec();
        chained.extend_from_slice(tail);
        assert_eq!(
            read(&chained, 5),
            Err(Unreadable::Damaged {
                at: second,
                later: stray
            }),
            "followed by {} bytes",
            tail.len()
        );
    }
}

/// Where a damaged frame's own length points, one whole frame is enough to tell damage from
/// a crash (a chance match at one offset is 2^-32): the frame before the last written,
/// damaged, does not drop the last one, although nothing follows it but zeros.
#[test]
fn one_whole_frame_where_the_damaged_one_ends_is_damage() {
    let (whole, second) = file(false);
    let mut bytes = whole[..second].to_vec();
    // The second frame's body damaged, its length intact, then a third frame and zeros.
    let mut damaged = whole[second..].to_vec();
    damaged[FRAME_HEADER] ^= 0x01;
    bytes.extend_from_slice(&damaged);
    let third = bytes.len();
    frame(5, SALT, &whole[second + FRAME_HEADER..], &mut bytes);
    bytes.extend_from_slice(&[0; 64]);
    assert_eq!(
        read(&bytes, 5),
        Err(Unreadable::Damaged {
            at: second,
            later: third
        })
    );
}

/// Segment 5's end frame.
fn end_frame() -> Vec<u8> {
    let mut out = Vec::new();
    frame(5, SALT, &[], &mut out);
    out
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
