//! Image files to pixels: JPEG through libjpeg-turbo (with its DCT-domain scaling when the image
//! is to be shrunk by half or more), PNG through the `image` crate. Every file becomes 8-bit RGB
//! or 8-bit grey, as torchvision's `ImageFolder` would give it (PIL's `convert("RGB")`):
//! greyscale is repeated into three channels, CMYK is converted, alpha is dropped and 16-bit
//! samples are scaled to 8. A file that does not decode whole (truncated, or not an image) is an
//! error: the caller decides whether that skips the sample.

use anyhow::{bail, ensure, Context, Result};
use std::cell::RefCell;
use std::ffi::CStr;
use turbojpeg::raw;

/// Pixels, interleaved: `channels` bytes per pixel, row after row.
#[derive(Debug, Clone, PartialEq)]
pub struct Pixels {
    pub width: u32,
    pub height: u32,
    /// 3 (RGB), 1 (grey), or 4 (RGB and a padding byte: `Out::Rgbx`).
    pub channels: u32,
    pub data: Vec<u8>,
}

/// Decodes `encoded` to RGB (`grey`: to one grey channel). `at_least`, given the file's (W,
/// H) from its header: the shorter side the caller will shrink the image to, if it will; a JPEG
/// may then be decoded at 1/2, 1/4 or 1/8 of its size (DCT-domain scaling, much cheaper than
/// decoding whole) as long as its shorter side stays at least that long. None: full size.
///
/// An image whose header claims more than `max_pixels` pixels is refused before anything is
/// decoded (a few hundred bytes can claim 30000 x 30000), like Pillow's decompression-bomb
/// check; so is a JPEG that libjpeg-turbo finds corrupt past a warning that leaves the image
/// whole (its header promises more data than the file has: the rest would come out grey).
pub fn decode(
    encoded: &[u8],
    grey: bool,
    max_pixels: u64,
    at_least: impl FnOnce(u32, u32) -> Option<u32>,
) -> Result<Pixels> {
    let out = if grey { Out::Grey } else { Out::Rgb };
    decode_into(encoded, out, max_pixels, at_least, Vec::new())
}

/// The pixels `decode_into` gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Out {
    /// 3 bytes a pixel.
    Rgb,
    /// 1 byte a pixel.
    Grey,
    /// RGB and a byte of padding, 4 bytes a pixel (`channels` 4): the layout the SIMD resizer
    /// handles fastest (1.5x RGB's speed at 500x375 -> 341x256), at no cost to libjpeg-turbo.
    Rgbx,
}

/// As `decode`, into `buf` (its allocation reused: a thread decoding many images allocates
/// once), in the layout `out`.
pub fn decode_into(
    encoded: &[u8],
    out: Out,
    max_pixels: u64,
    at_least: impl FnOnce(u32, u32) -> Option<u32>,
    buf: Vec<u8>,
) -> Result<Pixels> {
    if encoded.starts_with(&[0xFF, 0xD8]) {
        return with_decompressor(|h| decode_jpeg_with(h, encoded, out, max_pixels, at_least, buf));
    }
    let grey = out == Out::Grey;
    let reader = || {
        image::ImageReader::new(std::io::Cursor::new(encoded))
            .with_guessed_format()
            .context("reading the image's header")
    };
    let (w, h) = reader()?
        .into_dimensions()
        .context("not a JPEG, and not a PNG that decodes")?;
    check_pixels(w, h, max_pixels)?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(w);
    limits.max_image_height = Some(h);
    let mut reader = reader()?;
    reader.limits(limits);
    let img = reader
        .decode()
        .context("not a JPEG, and not a PNG that decodes")?;
    let (width, height) = (img.width(), img.height());
    if out == Out::Rgbx {
        return Ok(Pixels {
            width,
            height,
            channels: 4,
            data: padded(&img.into_rgb8().into_raw(), buf),
        });
    }
    Ok(if grey {
        Pixels {
            width,
            height,
            channels: 1,
            data: img.into_luma8().into_raw(),
        }
    } else {
        Pixels {
            width,
            height,
            channels: 3,
            data: img.into_rgb8().into_raw(),
        }
    })
}

/// Refuses an image of `w` x `h` over `max_pixels` (limits.max_image_pixels).
pub fn check_pixels(w: u32, h: u32, max_pixels: u64) -> Result<()> {
    let pixels = w as u64 * h as u64;
    ensure!(
        pixels <= max_pixels,
        "the image claims {w} x {h} = {pixels} pixels, over the {max_pixels} an image may have \
         (limits.max_image_pixels; a decompression bomb, or a lying header)"
    );
    Ok(())
}

/// A TurboJPEG decompressor, one per thread (creating one costs more than a small decode).
struct Handle(raw::tjhandle);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle came from tjInitDecompress and is destroyed once.
        unsafe { raw::tjDestroy(self.0) };
    }
}

thread_local! {
    static DECOMPRESSOR: RefCell<Option<Handle>> = const { RefCell::new(None) };
}

/// The scaling libjpeg-turbo applies fast (in the IDCT): 1/8, 1/4, 1/2, 1.
pub(crate) const DCT_SCALES: [u32; 4] = [8, 4, 2, 1];

fn with_decompressor<T>(f: impl FnOnce(raw::tjhandle) -> Result<T>) -> Result<T> {
    DECOMPRESSOR.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.is_none() {
            // SAFETY: no arguments; a null handle is checked.
            let h = unsafe { raw::tjInitDecompress() };
            ensure!(!h.is_null(), "libjpeg-turbo could not make a decompressor");
            *cell = Some(Handle(h));
        }
        let handle = cell.as_ref().map(|h| h.0).unwrap_or(std::ptr::null_mut());
        f(handle)
    })
}

/// The (W, H) a JPEG's header gives, if `encoded` is a JPEG (else None).
pub fn jpeg_size(encoded: &[u8]) -> Result<Option<(u32, u32)>> {
    if !encoded.starts_with(&[0xFF, 0xD8]) {
        return Ok(None);
    }
    with_decompressor(|h| jpeg_header(h, encoded).map(|(size, _)| Some(size)))
}

/// The JPEG's ((W, H), colorspace).
fn jpeg_header(h: raw::tjhandle, encoded: &[u8]) -> Result<((u32, u32), i32)> {
    let len = libc::c_ulong::try_from(encoded.len()).context("JPEG too large")?;
    let (mut w, mut hgt, mut subsamp, mut colorspace) = (0, 0, 0, 0);
    // SAFETY: `encoded` is valid for `len` bytes; the outputs are plain ints.
    let rc = unsafe {
        raw::tjDecompressHeader3(
            h,
            encoded.as_ptr(),
            len,
            &mut w,
            &mut hgt,
            &mut subsamp,
            &mut colorspace,
        )
    };
    if rc != 0 {
        bail!("not a JPEG that decodes: {}", error(h));
    }
    ensure!(
        w > 0 && hgt > 0,
        "the JPEG ends before its size (the file is cut short)"
    );
    Ok(((w as u32, hgt as u32), colorspace))
}

fn decode_jpeg_with(
    h: raw::tjhandle,
    encoded: &[u8],
    out: Out,
    max_pixels: u64,
    at_least: impl FnOnce(u32, u32) -> Option<u32>,
    mut data: Vec<u8>,
) -> Result<Pixels> {
    let ((w, hgt), colorspace) = jpeg_header(h, encoded)?;
    check_pixels(w, hgt, max_pixels)?;
    let len = encoded.len() as libc::c_ulong;
    // The largest DCT reduction that keeps the shorter side at least `at_least`.
    let denom = match at_least(w, hgt) {
        Some(t) if t > 0 => DCT_SCALES
            .into_iter()
            .find(|&d| w.min(hgt).div_ceil(d) >= t)
            .unwrap_or(1),
        _ => 1,
    };
    let (sw, sh) = (w.div_ceil(denom), hgt.div_ceil(denom));
    let cmyk = colorspace == raw::TJCS_TJCS_CMYK as i32 || colorspace == raw::TJCS_TJCS_YCCK as i32;
    let (format, channels) = match out {
        _ if cmyk => (raw::TJPF_TJPF_CMYK, 4),
        Out::Grey => (raw::TJPF_TJPF_GRAY, 1),
        Out::Rgb => (raw::TJPF_TJPF_RGB, 3),
        Out::Rgbx => (raw::TJPF_TJPF_RGBX, 4),
    };
    // Within max_pixels. Only what the buffer gains is zeroed: the decoder writes every byte.
    let need = sw as usize * sh as usize * channels;
    data.truncate(need);
    data.resize(need, 0);
    // SAFETY: `data` holds sh rows of sw pixels of `channels` bytes, the pitch given.
    let rc = unsafe {
        raw::tjDecompress2(
            h,
            encoded.as_ptr(),
            len,
            data.as_mut_ptr(),
            sw as i32,
            (sw as usize * channels) as i32,
            sh as i32,
            format,
            // A progressive JPEG of thousands of tiny scans takes minutes: refused.
            raw::TJFLAG_LIMITSCANS as i32,
        )
    };
    if rc != 0 {
        let message = error(h);
        // SAFETY: a valid handle.
        let fatal = unsafe { raw::tjGetErrorCode(h) } != raw::TJERR_TJERR_WARNING as i32;
        // A warning leaves the image decoded, but a file that ends early, or whose header
        // claims more rows than its data holds ("Corrupt JPEG data: premature end of data
        // segment"), is missing rows (the rest comes out grey): torchvision refuses it too
        // ("image file is truncated"). Other warnings (extraneous bytes) leave it whole.
        if fatal || message.to_ascii_lowercase().contains("premature end") {
            bail!("JPEG does not decode whole: {message}");
        }
    }
    if !cmyk {
        return Ok(Pixels {
            width: sw,
            height: sh,
            channels: channels as u32,
            data,
        });
    }
    let rgb = cmyk_to_rgb(&data, adobe_inverted(encoded));
    if out == Out::Rgbx {
        return Ok(Pixels {
            width: sw,
            height: sh,
            channels: 4,
            data: padded(&rgb, data),
        });
    }
    Ok(if out == Out::Grey {
        Pixels {
            width: sw,
            height: sh,
            channels: 1,
            data: rgb.chunks_exact(3).map(luma).collect(),
        }
    } else {
        Pixels {
            width: sw,
            height: sh,
            channels: 3,
            data: rgb,
        }
    })
}

/// RGB pixels with a byte of 255 after each (as libjpeg-turbo pads them), in `buf`'s
/// allocation.
fn padded(rgb: &[u8], mut buf: Vec<u8>) -> Vec<u8> {
    buf.clear();
    buf.extend(rgb.chunks_exact(3).flat_map(|p| [p[0], p[1], p[2], 255]));
    buf
}

fn error(h: raw::tjhandle) -> String {
    // SAFETY: tjGetErrorStr2 returns a NUL-terminated string owned by the handle (or static).
    unsafe { CStr::from_ptr(raw::tjGetErrorStr2(h)) }
        .to_string_lossy()
        .trim()
        .to_string()
}

/// ITU-R 601-2 luma, as PIL's `convert("L")`.
fn luma(px: &[u8]) -> u8 {
    ((px[0] as u32 * 19595 + px[1] as u32 * 38470 + px[2] as u32 * 7471 + 0x8000) >> 16) as u8
}

/// CMYK pixels to RGB as PIL converts them. Photoshop (and PIL) store CMYK JPEGs inverted and
/// say so with an Adobe marker: then 255 means no ink.
fn cmyk_to_rgb(cmyk: &[u8], inverted: bool) -> Vec<u8> {
    let mut rgb = Vec::with_capacity(cmyk.len() / 4 * 3);
    for px in cmyk.chunks_exact(4) {
        let [c, m, y, k] = if inverted {
            [255 - px[0], 255 - px[1], 255 - px[2], 255 - px[3]]
        } else {
            [px[0], px[1], px[2], px[3]]
        };
        let nk = 255 - k as u32;
        for v in [c, m, y] {
            // PIL: nk - v * nk / 255, rounded.
            let t = v as u32 * nk + 128;
            rgb.push((nk - ((t + (t >> 8)) >> 8)) as u8);
        }
    }
    rgb
}

/// Whether the JPEG has an Adobe APP14 marker (its CMYK values are then stored inverted).
fn adobe_inverted(jpeg: &[u8]) -> bool {
    let mut at = 2;
    while at + 4 <= jpeg.len() && jpeg[at] == 0xFF {
        let marker = jpeg[at + 1];
        if marker == 0xDA {
            break; // start of scan: no more headers
        }
        let len = u16::from_be_bytes([jpeg[at + 2], jpeg[at + 3]]) as usize;
        if marker == 0xEE && jpeg[at + 4..].starts_with(b"Adobe") {
            return true;
        }
        at += 2 + len;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A JPEG of `w` x `h` made by libjpeg-turbo from `pixels` (RGB, or grey with one channel).
    pub fn jpeg(w: u32, h: u32, pixels: &[u8], channels: u32) -> Vec<u8> {
        let format = if channels == 1 {
            turbojpeg::PixelFormat::GRAY
        } else {
            turbojpeg::PixelFormat::RGB
        };
        let image = turbojpeg::Image {
            pixels,
            width: w as usize,
            pitch: (w * channels) as usize,
            height: h as usize,
            format,
        };
        let sub = if channels == 1 {
            turbojpeg::Subsamp::Gray
        } else {
            turbojpeg::Subsamp::None
        };
        turbojpeg::compress(image, 95, sub).unwrap().to_vec()
    }

    fn gradient(w: u32, h: u32) -> Vec<u8> {
        (0..h)
            .flat_map(|y| (0..w).flat_map(move |x| [(x * 4) as u8, (y * 4) as u8, 128]))
            .collect()
    }

    #[test]
    fn jpegs_decode_to_rgb_close_to_their_pixels() {
        let px = gradient(64, 48);
        let p = decode(&jpeg(64, 48, &px, 3), false, u64::MAX, |_, _| None).unwrap();
        assert_eq!((p.width, p.height, p.channels), (64, 48, 3));
        let worst = p.data.iter().zip(&px).map(|(a, b)| a.abs_diff(*b)).max();
        assert!(worst.unwrap() <= 8, "{worst:?}");
        let g = decode(&jpeg(64, 48, &px, 3), true, u64::MAX, |_, _| None).unwrap();
        assert_eq!((g.channels, g.data.len()), (1, 64 * 48));
    }

    #[test]
    fn a_jpeg_to_be_shrunk_decodes_smaller_but_never_below_the_target() {
        let px = gradient(64, 48);
        let file = jpeg(64, 48, &px, 3);
        for (target, size) in [
            (48, (64, 48)),
            (24, (32, 24)),
            (13, (32, 24)),
            (12, (16, 12)),
            (6, (8, 6)),
            (2, (8, 6)),
        ] {
            let p = decode(&file, false, u64::MAX, |_, _| Some(target)).unwrap();
            assert_eq!((p.width, p.height), size, "target {target}");
        }
    }

    #[test]
    fn padded_rgb_is_rgb_and_a_byte_into_any_buffer() {
        let px = gradient(64, 48);
        let file = jpeg(64, 48, &px, 3);
        let mut grey = px.clone();
        grey.truncate(64 * 48);
        for (file, at_least) in [(file, None), (jpeg(64, 48, &grey, 1), Some(24))] {
            let rgb = decode(&file, false, u64::MAX, |_, _| at_least).unwrap();
            for buf in [Vec::new(), vec![7; 5], vec![9; 100_000]] {
                let x = decode_into(&file, Out::Rgbx, u64::MAX, |_, _| at_least, buf).unwrap();
                assert_eq!((x.width, x.height, x.channels), (rgb.width, rgb.height, 4));
                let unpadded: Vec<u8> = (x.data.chunks_exact(4))
                    .flat_map(|p| &p[..3])
                    .copied()
                    .collect();
                assert!(unpadded == rgb.data, "RGBX's RGB differ from RGB's");
            }
        }
    }

    #[test]
    fn grey_jpegs_become_three_equal_channels() {
        let px: Vec<u8> = (0..32 * 16).map(|i| (i % 200) as u8).collect();
        let p = decode(&jpeg(32, 16, &px, 1), false, u64::MAX, |_, _| None).unwrap();
        assert_eq!(p.channels, 3);
        assert!(p.data.chunks_exact(3).all(|c| c[0] == c[1] && c[1] == c[2]));
    }

    #[test]
    fn truncated_and_garbage_files_are_errors() {
        let file = jpeg(64, 48, &gradient(64, 48), 3);
        let err = decode(&file[..file.len() / 2], false, u64::MAX, |_, _| None).unwrap_err();
        assert!(
            format!("{err:#}").contains("does not decode whole"),
            "{err:#}"
        );
        let mut png_head = b"\x89PNG\r\n\x1a\n".to_vec();
        png_head.extend_from_slice(&[7; 100]);
        assert!(decode(&png_head, false, u64::MAX, |_, _| None).is_err());
        assert!(decode(b"\xFF\xD8 not really", false, u64::MAX, |_, _| None).is_err());
    }

    #[test]
    fn cmyk_converts_like_pil() {
        // No ink is white, full black ink is black, full cyan is (0, 255, 255).
        assert_eq!(
            cmyk_to_rgb(&[0, 0, 0, 0, 0, 0, 0, 255, 255, 0, 0, 0], false),
            [255, 255, 255, 0, 0, 0, 0, 255, 255]
        );
        assert_eq!(cmyk_to_rgb(&[255, 255, 255, 255], true), [255, 255, 255]);
    }
}
