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

/// Interleaved pixels of `channels` bytes (1, 3 or 4) resized from (w, h) to (nw, nh).
pub fn resize_interleaved(
    src: &[u8],
    (w, h): (u32, u32),
    channels: u32,
    (nw, nh): (u32, u32),
    resample: Resample,
) -> Result<Vec<u8>> {
    if (w, h) == (nw, nh) {
        return Ok(src.to_vec());
    }
    let pixel = match channels {
        1 => PixelType::U8,
        3 => PixelType::U8x3,
        4 => PixelType::U8x4,
        c => anyhow::bail!("cannot resize pixels of {c} channels"),
    };
    let src = ImageRef::new(w, h, src, pixel).context("image buffer")?;
    let mut dst = Image::new(nw, nh, pixel);
    RESIZER.with(|r| {
        r.borrow_mut().resize(
            &src,
            &mut dst,
            &ResizeOptions::new().resize_alg(algorithm(resample)),
        )
    })?;
    Ok(dst.into_vec())
}

/// Interleaved RGB as three planes: [3, H, W].
pub fn to_planes(rgb: &[u8], channels: usize) -> Vec<u8> {
    if channels == 1 {
        return rgb.to_vec();
    }
    let plane = rgb.len() / channels;
    let mut out = vec![0u8; rgb.len()];
    if channels == 3 {
        // One pass, three outputs.
        let (r, rest) = out.split_at_mut(plane);
        let (g, b) = rest.split_at_mut(plane);
        for (((px, r), g), b) in rgb.chunks_exact(3).zip(r).zip(g).zip(b) {
            (*r, *g, *b) = (px[0], px[1], px[2]);
        }
        return out;
    }
    for c in 0..channels {
        for (o, px) in out[c * plane..(c + 1) * plane]
            .iter_mut()
            .zip(rgb.chunks_exact(channels))
        {
            *o = px[c];
        }
    }
    out
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
        assert_eq!(to_planes(&small, 3), [[10; 4], [20; 4], [30; 4]].concat());
    }
}
