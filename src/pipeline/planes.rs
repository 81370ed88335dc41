//! Geometry on images stored as planes (a field [..., H, W] is planes of H x W, one after the
//! other): resizing, and cutting a box out to a given size, flipped or not. Resampling is SIMD
//! (`fast_image_resize`): bilinear with antialiasing when shrinking (as Pillow, and so
//! torchvision on PIL images, does it), or nearest for masks and ids. Boxes that are only cut
//! (not resized) work on any element size and may reach past the image: what lies outside is
//! zero (padding).

use crate::fields::Resample;
use anyhow::{ensure, Context, Result};
use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use std::cell::RefCell;

thread_local! {
    /// Resizers keep buffers between calls.
    static RESIZER: RefCell<Resizer> = RefCell::new(Resizer::new());
}

fn algorithm(resample: Resample) -> ResizeAlg {
    match resample {
        Resample::Nearest => ResizeAlg::Nearest,
        Resample::Linear => ResizeAlg::Convolution(FilterType::Bilinear),
        Resample::Cubic => ResizeAlg::Convolution(FilterType::CatmullRom),
    }
}

/// Interleaved pixels of `channels` bytes (1, 3, or 4: RGB and a padding byte, which is not
/// alpha) resized from (w, h) to (nw, nh).
pub fn resize_interleaved(
    src: &[u8],
    (w, h): (u32, u32),
    channels: u32,
    (nw, nh): (u32, u32),
    resample: Resample,
) -> Result<Vec<u8>> {
    resize_interleaved_into(src, (w, h), channels, (nw, nh), resample, Vec::new())
}

/// As `resize_interleaved`, into `buf`'s allocation (reused: a thread resizing many images
/// allocates once).
pub fn resize_interleaved_into(
    src: &[u8],
    (w, h): (u32, u32),
    channels: u32,
    (nw, nh): (u32, u32),
    resample: Resample,
    mut buf: Vec<u8>,
) -> Result<Vec<u8>> {
    if (w, h) == (nw, nh) {
        buf.clear();
        buf.extend_from_slice(src);
        return Ok(buf);
    }
    resize(src, (w, h), channels, None, (nw, nh), resample, buf)
}

/// The box (left, top, width, height, in pixels of `src`, fractions allowed) of interleaved
/// pixels of `channels` bytes resized to (nw, nh): each output pixel's window and weights as
/// resizing the whole image would give them at the box's scale (fast_image_resize's crop).
pub fn resize_box_into(
    src: &[u8],
    (w, h): (u32, u32),
    channels: u32,
    area: (f64, f64, f64, f64),
    (nw, nh): (u32, u32),
    resample: Resample,
    buf: Vec<u8>,
) -> Result<Vec<u8>> {
    resize(src, (w, h), channels, Some(area), (nw, nh), resample, buf)
}

/// `src` (or its box `area`) resized to (nw, nh) in `buf`'s allocation.
fn resize(
    src: &[u8],
    (w, h): (u32, u32),
    channels: u32,
    area: Option<(f64, f64, f64, f64)>,
    (nw, nh): (u32, u32),
    resample: Resample,
    mut buf: Vec<u8>,
) -> Result<Vec<u8>> {
    let pixel = match channels {
        1 => PixelType::U8,
        3 => PixelType::U8x3,
        4 => PixelType::U8x4,
        c => anyhow::bail!("cannot resize pixels of {c} channels"),
    };
    let src = ImageRef::new(w, h, src, pixel).context("image buffer")?;
    // Only what the buffer gains is zeroed: the resizer writes every byte.
    let len = nw as usize * nh as usize * channels as usize;
    buf.truncate(len);
    buf.resize(len, 0);
    let mut dst = Image::from_vec_u8(nw, nh, buf, pixel).context("output buffer")?;
    // A fourth byte is padding, not alpha.
    let mut options = ResizeOptions::new()
        .resize_alg(algorithm(resample))
        .use_alpha(false);
    if let Some((left, top, bw, bh)) = area {
        options = options.crop(left, top, bw, bh);
    }
    RESIZER.with(|r| r.borrow_mut().resize(&src, &mut dst, &options))?;
    Ok(dst.into_vec())
}

/// RGB pixels padded to 4 bytes (`decode::Out::Rgbx`) as three planes: [3, H, W]. SIMD
/// (SSSE3) where the CPU has it: 8% of a cold epoch's CPU went to the plain loop over 3-byte
/// pixels this replaced, a few tenths of a percent to this.
pub fn rgbx_to_planes(rgbx: &[u8]) -> Vec<u8> {
    let n = rgbx.len() / 4;
    let mut out = vec![0u8; 3 * n];
    let (r, rest) = out.split_at_mut(n);
    let (g, b) = rest.split_at_mut(n);
    let done = rgbx_to_planes_simd(rgbx, r, g, b);
    for (i, px) in rgbx.chunks_exact(4).enumerate().skip(done) {
        (r[i], g[i], b[i]) = (px[0], px[1], px[2]);
    }
    out
}

/// As many pixels of `rgbx` as SIMD does here into `r`, `g` and `b`; returns how many.
fn rgbx_to_planes_simd(rgbx: &[u8], r: &mut [u8], g: &mut [u8], b: &mut [u8]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("ssse3") {
        // SAFETY: the CPU has SSSE3; the function bounds itself by the slices' lengths.
        return unsafe { rgbx_to_planes_ssse3(rgbx, r, g, b) };
    }
    let _ = (rgbx, r, g, b);
    0
}

/// The first multiple of 16 pixels of `rgbx` into `r`, `g` and `b` (each at least that long);
/// returns how many pixels it did.
///
/// # Safety
///
/// The CPU must have SSSE3 (`is_x86_feature_detected!("ssse3")`); the slices bound every
/// access.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
unsafe fn rgbx_to_planes_ssse3(rgbx: &[u8], r: &mut [u8], g: &mut [u8], b: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let n = (rgbx.len() / 4).min(r.len()).min(g.len()).min(b.len()) / 16 * 16;
    // Within 4 pixels: the R bytes to lanes 0-3, G to 4-7, B to 8-11 (and padding to 12-15).
    let gather = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let src = rgbx.as_ptr();
    for i in (0..n).step_by(16) {
        // SAFETY: pixels i..i+16 are within `rgbx`, and i+16 <= n within r, g and b.
        unsafe {
            let p = src.add(4 * i) as *const __m128i;
            let t0 = _mm_shuffle_epi8(_mm_loadu_si128(p), gather);
            let t1 = _mm_shuffle_epi8(_mm_loadu_si128(p.add(1)), gather);
            let t2 = _mm_shuffle_epi8(_mm_loadu_si128(p.add(2)), gather);
            let t3 = _mm_shuffle_epi8(_mm_loadu_si128(p.add(3)), gather);
            // A 4x4 transpose of 32-bit lanes: [R G B X] of four registers to R, G, B rows.
            let rg01 = _mm_unpacklo_epi32(t0, t1);
            let rg23 = _mm_unpacklo_epi32(t2, t3);
            let bx01 = _mm_unpackhi_epi32(t0, t1);
            let bx23 = _mm_unpackhi_epi32(t2, t3);
            _mm_storeu_si128(
                r.as_mut_ptr().add(i) as *mut __m128i,
                _mm_unpacklo_epi64(rg01, rg23),
            );
            _mm_storeu_si128(
                g.as_mut_ptr().add(i) as *mut __m128i,
                _mm_unpackhi_epi64(rg01, rg23),
            );
            _mm_storeu_si128(
                b.as_mut_ptr().add(i) as *mut __m128i,
                _mm_unpacklo_epi64(bx01, bx23),
            );
        }
    }
    n
}

/// A box in a plane's pixels: (x, y) may be negative or reach past the plane when it is only
/// cut, never when it is resized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoxI {
    pub x: i64,
    pub y: i64,
    pub w: u32,
    pub h: u32,
}

/// Cuts `bx` out of each of the planes in `src` (each `w` x `h` elements of `item` bytes) to
/// (ow, oh), mirrored left to right when `flip`, into `dst` (exactly planes x ow x oh x item
/// bytes). A box of the output's size is copied (zeros outside the plane); any other is
/// resampled, which needs uint8 (`item` 1) and a box inside the plane.
#[allow(clippy::too_many_arguments)]
pub fn cut(
    src: &[u8],
    (w, h): (u32, u32),
    item: usize,
    bx: BoxI,
    (ow, oh): (u32, u32),
    flip: bool,
    resample: Resample,
    dst: &mut [u8],
) -> Result<()> {
    let plane_in = w as usize * h as usize * item;
    let plane_out = ow as usize * oh as usize * item;
    ensure!(
        plane_in > 0 && src.len().is_multiple_of(plane_in),
        "a plane of {w}x{h} in {} bytes",
        src.len()
    );
    let planes = src.len() / plane_in;
    ensure!(
        dst.len() == planes * plane_out,
        "{} bytes for {planes} planes of {ow}x{oh}",
        dst.len()
    );
    let copy = (bx.w, bx.h) == (ow, oh);
    if !copy {
        ensure!(item == 1, "only uint8 fields are resized");
        ensure!(
            bx.x >= 0
                && bx.y >= 0
                && bx.x as u64 + bx.w as u64 <= w as u64
                && bx.y as u64 + bx.h as u64 <= h as u64
                && bx.w > 0
                && bx.h > 0,
            "box {bx:?} outside the {w}x{h} image"
        );
    }
    if !copy && planes == 3 {
        // Three planes (RGB) resample faster together, as interleaved pixels: gathered from the
        // box, resized once, scattered back into planes (mirrored there, when flipped).
        return cut_rgb(src, (w, h), bx, (ow, oh), flip, resample, dst);
    }
    for (p, out) in src
        .chunks_exact(plane_in)
        .zip(dst.chunks_exact_mut(plane_out))
    {
        if copy {
            copy_box(p, (w, h), item, bx, out);
        } else {
            let src = ImageRef::new(w, h, p, PixelType::U8).context("plane")?;
            let mut d = Image::from_slice_u8(ow, oh, out, PixelType::U8).context("output plane")?;
            let options = ResizeOptions::new().resize_alg(algorithm(resample)).crop(
                bx.x as f64,
                bx.y as f64,
                bx.w as f64,
                bx.h as f64,
            );
            RESIZER.with(|r| r.borrow_mut().resize(&src, &mut d, &options))?;
        }
        if flip {
            for row in out.chunks_exact_mut(ow as usize * item) {
                mirror(row, item);
            }
        }
    }
    Ok(())
}

thread_local! {
    /// The interleaved box and its resized pixels, kept between calls.
    static SCRATCH: RefCell<(Vec<u8>, Vec<u8>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `cut` of three uint8 planes through one resize of interleaved pixels (4 bytes each, the
/// layout the SIMD resizer handles fastest).
fn cut_rgb(
    src: &[u8],
    (w, h): (u32, u32),
    bx: BoxI,
    (ow, oh): (u32, u32),
    flip: bool,
    resample: Resample,
    dst: &mut [u8],
) -> Result<()> {
    let plane = w as usize * h as usize;
    let (r, g, b) = (
        &src[..plane],
        &src[plane..2 * plane],
        &src[2 * plane..3 * plane],
    );
    let (bw, bh) = (bx.w as usize, bx.h as usize);
    SCRATCH.with(|cell| {
        let (boxed, resized) = &mut *cell.borrow_mut();
        boxed.resize(bw * bh * 4, 0);
        for y in 0..bh {
            let from = (bx.y as usize + y) * w as usize + bx.x as usize;
            let row = &mut boxed[y * bw * 4..(y + 1) * bw * 4];
            for (x, px) in row.chunks_exact_mut(4).enumerate() {
                px[0] = r[from + x];
                px[1] = g[from + x];
                px[2] = b[from + x];
            }
        }
        resized.resize(ow as usize * oh as usize * 4, 0);
        let from = ImageRef::new(bx.w, bx.h, boxed, PixelType::U8x4).context("box")?;
        let mut to = Image::from_slice_u8(ow, oh, resized, PixelType::U8x4).context("output")?;
        RESIZER.with(|rs| {
            rs.borrow_mut().resize(
                &from,
                &mut to,
                // The fourth byte is padding, not alpha.
                &ResizeOptions::new()
                    .resize_alg(algorithm(resample))
                    .use_alpha(false),
            )
        })?;
        let out_plane = ow as usize * oh as usize;
        let (dr, rest) = dst.split_at_mut(out_plane);
        let (dg, db) = rest.split_at_mut(out_plane);
        let ow = ow as usize;
        for (y, row) in resized.chunks_exact(ow * 4).enumerate() {
            let at = y * ow;
            for (x, px) in row.chunks_exact(4).enumerate() {
                let i = at + if flip { ow - 1 - x } else { x };
                dr[i] = px[0];
                dg[i] = px[1];
                db[i] = px[2];
            }
        }
        Ok(())
    })
}

/// The box's rows of one plane into `out` (box-sized), zeros where the box is outside.
fn copy_box(src: &[u8], (w, h): (u32, u32), item: usize, bx: BoxI, out: &mut [u8]) {
    let row_out = bx.w as usize * item;
    // Columns of the box inside the plane.
    let x0 = bx.x.max(0);
    let x1 = (bx.x + bx.w as i64).min(w as i64);
    for (r, row) in out.chunks_exact_mut(row_out).enumerate() {
        let y = bx.y + r as i64;
        if y < 0 || y >= h as i64 || x0 >= x1 {
            row.fill(0);
            continue;
        }
        let left = ((x0 - bx.x) as usize) * item;
        let n = ((x1 - x0) as usize) * item;
        let from = (y as usize * w as usize + x0 as usize) * item;
        row[..left].fill(0);
        row[left..left + n].copy_from_slice(&src[from..from + n]);
        row[left + n..].fill(0);
    }
}

/// Reverses the order of a row's elements of `item` bytes.
fn mirror(row: &mut [u8], item: usize) {
    if item == 1 {
        row.reverse();
        return;
    }
    let n = row.len() / item;
    for i in 0..n / 2 {
        let (a, b) = (i * item, (n - 1 - i) * item);
        for k in 0..item {
            row.swap(a + k, b + k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Interleaved RGB as three planes, the plain way: what `rgbx_to_planes` must give.
    fn planes_of_rgb(rgb: &[u8]) -> Vec<u8> {
        (0..3)
            .flat_map(|c| rgb.iter().skip(c).step_by(3).copied())
            .collect()
    }

    /// Pseudo-random bytes (a fixed LCG), photo-like enough for the resizer's rounding.
    fn noise(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn padded_rgb_resizes_and_splits_exactly_as_rgb() {
        // Sizes that leave a tail of fewer than 16 pixels for the plain loop, shrinking,
        // growing and unchanged.
        for ((w, h), (nw, nh)) in [
            ((500, 375), (341, 256)),
            ((37, 23), (19, 11)),
            ((13, 7), (29, 17)),
            ((5, 3), (5, 3)),
        ] {
            let rgb = noise(w * h * 3, (w * h) as u32);
            let rgbx: Vec<u8> = rgb
                .chunks_exact(3)
                .flat_map(|p| [p[0], p[1], p[2], 0])
                .collect();
            let size = ((w as u32, h as u32), (nw as u32, nh as u32));
            for resample in [Resample::Linear, Resample::Cubic, Resample::Nearest] {
                let a = resize_interleaved(&rgb, size.0, 3, size.1, resample).unwrap();
                let b = resize_interleaved(&rgbx, size.0, 4, size.1, resample).unwrap();
                let reused =
                    resize_interleaved_into(&rgbx, size.0, 4, size.1, resample, noise(9, 1));
                assert_eq!(b, reused.unwrap());
                assert_eq!(
                    planes_of_rgb(&a),
                    rgbx_to_planes(&b),
                    "{size:?} {resample:?}"
                );
            }
        }
    }

    #[test]
    fn boxes_are_copied_with_zero_padding_and_flipped() {
        // One 4x3 plane: value = 10 * row + column + 1.
        let src: Vec<u8> = (0..3)
            .flat_map(|y| (0..4).map(move |x| 10 * y + x + 1))
            .collect();
        let mut out = vec![9u8; 9];
        let bx = BoxI {
            x: -1,
            y: 1,
            w: 3,
            h: 3,
        };
        cut(
            &src,
            (4, 3),
            1,
            bx,
            (3, 3),
            false,
            Resample::Linear,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [0, 11, 12, 0, 21, 22, 0, 0, 0]);
        cut(
            &src,
            (4, 3),
            1,
            bx,
            (3, 3),
            true,
            Resample::Linear,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [12, 11, 0, 22, 21, 0, 0, 0, 0]);
        // Two planes of 2-byte elements.
        let wide: Vec<u8> = (0..16).collect();
        let mut out = vec![0u8; 8];
        let bx = BoxI {
            x: 0,
            y: 0,
            w: 2,
            h: 1,
        };
        cut(
            &wide,
            (2, 2),
            2,
            bx,
            (2, 1),
            true,
            Resample::Nearest,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [2, 3, 0, 1, 10, 11, 8, 9]);
    }

    #[test]
    fn boxes_of_another_size_are_resampled() {
        // Left half 0, right half 200; nearest keeps values, linear blends at the edge only.
        let src: Vec<u8> = (0..8)
            .flat_map(|_| (0..8).map(|x| if x < 4 { 0 } else { 200 }))
            .collect();
        let mut out = vec![0u8; 16];
        let bx = BoxI {
            x: 0,
            y: 0,
            w: 8,
            h: 8,
        };
        cut(
            &src,
            (8, 8),
            1,
            bx,
            (4, 4),
            false,
            Resample::Nearest,
            &mut out,
        )
        .unwrap();
        assert!(out.iter().all(|&v| v == 0 || v == 200));
        assert_eq!(&out[..4], &[0, 0, 200, 200]);
        cut(
            &src,
            (8, 8),
            1,
            bx,
            (4, 4),
            false,
            Resample::Linear,
            &mut out,
        )
        .unwrap();
        assert_eq!((out[0], out[3]), (0, 200));
        let bad = BoxI {
            x: 6,
            y: 0,
            w: 4,
            h: 4,
        };
        assert!(cut(
            &src,
            (8, 8),
            1,
            bad,
            (2, 2),
            false,
            Resample::Linear,
            &mut out[..4]
        )
        .is_err());
    }

    #[test]
    fn three_planes_resample_together_as_each_would_alone() {
        let (w, h) = (40u32, 30u32);
        let src: Vec<u8> = (0..3 * w * h).map(|i| ((i * 37) % 251) as u8).collect();
        let bx = BoxI {
            x: 5,
            y: 3,
            w: 27,
            h: 20,
        };
        for flip in [false, true] {
            let mut together = vec![0u8; 3 * 16 * 12];
            cut(
                &src,
                (w, h),
                1,
                bx,
                (16, 12),
                flip,
                Resample::Linear,
                &mut together,
            )
            .unwrap();
            for c in 0..3 {
                // As torchvision's resized_crop: the box cut out first, then resized.
                let plane = &src[c * (w * h) as usize..(c + 1) * (w * h) as usize];
                let mut boxed = vec![0u8; 27 * 20];
                let lin = Resample::Linear;
                cut(plane, (w, h), 1, bx, (27, 20), false, lin, &mut boxed).unwrap();
                let whole = BoxI {
                    x: 0,
                    y: 0,
                    w: 27,
                    h: 20,
                };
                let mut alone = vec![0u8; 16 * 12];
                cut(
                    &boxed,
                    (27, 20),
                    1,
                    whole,
                    (16, 12),
                    flip,
                    Resample::Linear,
                    &mut alone,
                )
                .unwrap();
                let got = &together[c * 192..(c + 1) * 192];
                let worst = got
                    .iter()
                    .zip(&alone)
                    .map(|(a, b)| a.abs_diff(*b))
                    .max()
                    .unwrap();
                assert!(worst <= 1, "plane {c}, flip {flip}: off by {worst}");
            }
        }
    }

    #[test]
    fn interleaved_pixels_resize_and_become_planes() {
        let rgb: Vec<u8> = (0..4 * 4).flat_map(|_| [10, 20, 30]).collect();
        let small = resize_interleaved(&rgb, (4, 4), 3, (2, 2), Resample::Linear).unwrap();
        assert_eq!(small, [10, 20, 30].repeat(4));
        let padded: Vec<u8> = (0..4 * 4).flat_map(|_| [10, 20, 30, 255]).collect();
        let small = resize_interleaved(&padded, (4, 4), 4, (2, 2), Resample::Linear).unwrap();
        assert_eq!(rgbx_to_planes(&small), [[10; 4], [20; 4], [30; 4]].concat());
    }
}
