//! A JPEG's EXIF orientation (tag 0x0112), and the pixels turned upright by it, as Pillow's
//! `ImageOps.exif_transpose` (which Hugging Face `datasets` applies when it decodes an image)
//! turns them. Phone photos are stored sideways with the tag saying so.

/// The orientation a JPEG's EXIF data gives (1..=8), 1 when it has none or it does not parse.
pub fn orientation(jpeg: &[u8]) -> u8 {
    find(jpeg).filter(|o| (1..=8).contains(o)).unwrap_or(1)
}

fn find(jpeg: &[u8]) -> Option<u8> {
    if !jpeg.starts_with(&[0xFF, 0xD8]) {
        return None;
    }
    let mut p = 2usize;
    // Segments up to the start of scan: APP1 with "Exif\0\0" holds the TIFF header.
    while p + 4 <= jpeg.len() {
        if jpeg[p] != 0xFF {
            return None;
        }
        let marker = jpeg[p + 1];
        if marker == 0xDA || marker == 0xD9 {
            return None;
        }
        let len = u16::from_be_bytes([jpeg[p + 2], jpeg[p + 3]]) as usize;
        let seg = jpeg.get(p + 4..p + 2 + len)?;
        if marker == 0xE1 && seg.starts_with(b"Exif\0\0") {
            return tiff_orientation(&seg[6..]);
        }
        p += 2 + len;
    }
    None
}

fn tiff_orientation(t: &[u8]) -> Option<u8> {
    let little = match t.get(..2)? {
        b"II" => true,
        b"MM" => false,
        _ => return None,
    };
    let u16_at = |at: usize| -> Option<u16> {
        let b = t.get(at..at + 2)?;
        Some(if little {
            u16::from_le_bytes([b[0], b[1]])
        } else {
            u16::from_be_bytes([b[0], b[1]])
        })
    };
    let u32_at = |at: usize| -> Option<u32> {
        let b = t.get(at..at + 4)?;
        let b = [b[0], b[1], b[2], b[3]];
        Some(if little {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        })
    };
    if u16_at(2)? != 42 {
        return None;
    }
    let ifd = u32_at(4)? as usize;
    let n = u16_at(ifd)? as usize;
    for k in 0..n.min(1000) {
        let e = ifd + 2 + 12 * k;
        if u16_at(e)? == 0x0112 {
            // Type SHORT, one value, in the entry's first two value bytes.
            return (u16_at(e + 2)? == 3)
                .then(|| u16_at(e + 8))
                .flatten()
                .map(|v| v as u8);
        }
    }
    None
}

/// `px` (`w` x `h` pixels of `c` bytes) turned upright for orientation `o`: the new pixels and
/// their (w, h).
pub fn upright(px: &[u8], (w, h): (u32, u32), c: usize, o: u8) -> (Vec<u8>, (u32, u32)) {
    let (w, h) = (w as usize, h as usize);
    let swap = o >= 5;
    let (ow, oh) = if swap { (h, w) } else { (w, h) };
    let mut out = vec![0u8; px.len()];
    for y in 0..h {
        for x in 0..w {
            let (nx, ny) = match o {
                2 => (w - 1 - x, y),
                3 => (w - 1 - x, h - 1 - y),
                4 => (x, h - 1 - y),
                5 => (y, x),
                6 => (h - 1 - y, x),
                7 => (h - 1 - y, w - 1 - x),
                8 => (y, w - 1 - x),
                _ => (x, y),
            };
            let (from, to) = ((y * w + x) * c, (ny * ow + nx) * c);
            out[to..to + c].copy_from_slice(&px[from..from + c]);
        }
    }
    (out, (ow as u32, oh as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_orientation_turns_a_2x3_image_as_pillow_does() {
        // Pixels numbered row by row: 0 1 / 2 3 / 4 5 (w 2, h 3).
        let px: Vec<u8> = (0..6).collect();
        let turned = |o| upright(&px, (2, 3), 1, o);
        assert_eq!(turned(1), (px.clone(), (2, 3)));
        assert_eq!(turned(2), (vec![1, 0, 3, 2, 5, 4], (2, 3)));
        assert_eq!(turned(3), (vec![5, 4, 3, 2, 1, 0], (2, 3)));
        assert_eq!(turned(4), (vec![4, 5, 2, 3, 0, 1], (2, 3)));
        assert_eq!(turned(5), (vec![0, 2, 4, 1, 3, 5], (3, 2)));
        // 6: 90 degrees clockwise.
        assert_eq!(turned(6), (vec![4, 2, 0, 5, 3, 1], (3, 2)));
        assert_eq!(turned(7), (vec![5, 3, 1, 4, 2, 0], (3, 2)));
        // 8: 90 degrees counter-clockwise.
        assert_eq!(turned(8), (vec![1, 3, 5, 0, 2, 4], (3, 2)));
    }

    #[test]
    fn the_tag_is_found_in_either_byte_order_and_junk_is_orientation_1() {
        let jpeg = |tiff: &[u8]| {
            let mut seg = b"Exif\0\0".to_vec();
            seg.extend_from_slice(tiff);
            let mut j = vec![0xFF, 0xD8, 0xFF, 0xE1];
            j.extend_from_slice(&((seg.len() + 2) as u16).to_be_bytes());
            j.extend_from_slice(&seg);
            j.extend_from_slice(&[0xFF, 0xDA, 0, 2]);
            j
        };
        let le = [
            b'I', b'I', 42, 0, 8, 0, 0, 0, 1, 0, 0x12, 0x01, 3, 0, 1, 0, 0, 0, 6, 0, 0, 0,
        ];
        assert_eq!(orientation(&jpeg(&le)), 6);
        let be = [
            b'M', b'M', 0, 42, 0, 0, 0, 8, 0, 1, 0x01, 0x12, 0, 3, 0, 0, 0, 1, 0, 8, 0, 0,
        ];
        assert_eq!(orientation(&jpeg(&be)), 8);
        assert_eq!(orientation(&jpeg(&le[..12])), 1);
        assert_eq!(orientation(b"\xFF\xD8\xFF\xE1\xFF\xFF"), 1);
        assert_eq!(orientation(b"\x89PNG"), 1);
    }
}
