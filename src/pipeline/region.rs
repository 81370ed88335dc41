//! An image kept at its eval crop, decoded only where the crop reads (`decode = "region"`).
//!
//! Today's pixels are: the file decoded whole (at 1/2, 1/4 or 1/8 where the size kept allows),
//! resized to the size kept, the centered crop x crop cut out. Each output pixel of that is a
//! weighted sum over a window of decoded pixels around its center; the crop's pixels read only
//! the decoded pixels under the crop's box widened by the filter's reach. So the same output
//! comes from decoding that rectangle alone (libjpeg's `jpeg_crop_scanline` and
//! `jpeg_skip_scanlines`, through `jpeg_region.c`) and resizing the box within it to crop x crop
//! with the same scale: the same windows, the same weights, up to the rounding of a float. The
//! rows above the rectangle are still entropy-decoded (a baseline JPEG has no index into its
//! rows), but not transformed, upsampled or converted; nor are the columns beside it.

use super::decode::{self, DCT_SCALES};
use super::planes::{resize_box_into, rgbx_to_planes};
use crate::fields::{Resample, Value};
use anyhow::{bail, Result};
use std::ffi::{c_char, c_int, c_uint, c_ulong};

extern "C" {
    fn larder_jpeg_scaled_size(
        data: *const u8,
        len: c_ulong,
        denom: c_uint,
        w: *mut c_uint,
        h: *mut c_uint,
        msg: *mut c_char,
        msg_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn larder_jpeg_region(
        data: *const u8,
        len: c_ulong,
        denom: c_uint,
        x0: c_uint,
        y0: c_uint,
        cols: c_uint,
        rows: c_uint,
        out: *mut u8,
        stride: usize,
        spare: *mut u8,
        got_x: *mut c_uint,
        got_cols: *mut c_uint,
        warnings: *mut c_int,
        truncated: *mut c_int,
        msg: *mut c_char,
        msg_len: usize,
    ) -> c_int;
}

const OK: c_int = 0;
const NOT_HERE: c_int = 2;

/// The JPEG `encoded`'s (W, H) as decoded at 1/denom.
fn scaled_size(encoded: &[u8], denom: u32) -> Result<(u32, u32)> {
    let mut msg = [0 as c_char; 200];
    let (mut w, mut h) = (0, 0);
    // SAFETY: `encoded` is valid for its length; the outputs and message buffer are ours, the
    // message's length given.
    let rc = unsafe {
        larder_jpeg_scaled_size(
            encoded.as_ptr(),
            encoded.len() as c_ulong,
            denom,
            &mut w,
            &mut h,
            msg.as_mut_ptr(),
            msg.len(),
        )
    };
    if rc != OK {
        bail!("not a JPEG that decodes: {}", text(&msg));
    }
    Ok((w, h))
}

fn text(msg: &[c_char]) -> String {
    // SAFETY: the shim writes a NUL-terminated string within the buffer (snprintf), or leaves
    // it zeroed.
    unsafe { std::ffi::CStr::from_ptr(msg.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// How far (in decoded pixels, either side of a pixel's center) a resample reaches when it
/// shrinks by `scale`, with a pixel to spare: fast_image_resize's filters (bilinear 1,
/// bicubic 2, Lanczos 3) widened by the scale.
fn reach(resample: Resample, scale: f64) -> u32 {
    let support = match resample {
        Resample::Nearest => 1.0,
        Resample::Linear => 1.0,
        Resample::Cubic => 2.0,
    };
    (support * scale.max(1.0)).ceil() as u32 + 2
}

/// What the image of `encoded` (a JPEG of header size `full`, to be kept at `kept` = (W, H),
/// then cut to its centered `crop` x `crop`) is kept as: [3, crop, crop], decoded only over the
/// crop's reach. None where this does not apply (not a baseline YCbCr JPEG, an image smaller
/// than the crop): the caller decodes it whole.
pub fn kept_at_crop(
    encoded: &[u8],
    full: (u32, u32),
    kept: (u32, u32),
    crop: u32,
    resample: Resample,
    max_pixels: u64,
) -> Result<Option<Value>> {
    let (nw, nh) = kept;
    if nw < crop || nh < crop || crop == 0 {
        return Ok(None);
    }
    // The DCT scale a whole decode takes (decode::decode_into's rule).
    let denom = DCT_SCALES
        .into_iter()
        .find(|&d| full.0.min(full.1).div_ceil(d) >= nw.min(nh))
        .unwrap_or(1);
    let (w, h) = scaled_size(encoded, denom)?;
    decode::check_pixels(w, h, max_pixels)?;
    let (sx, sy) = (w as f64 / nw as f64, h as f64 / nh as f64);
    let (cx, cy) = (
        super::augment::center(nw, crop) as f64,
        super::augment::center(nh, crop) as f64,
    );
    // The crop's box in decoded pixels, and the rectangle its windows read.
    let (left, top, bw, bh) = (cx * sx, cy * sy, crop as f64 * sx, crop as f64 * sy);
    let (rx, ry) = (reach(resample, sx), reach(resample, sy));
    let x0 = (left.floor() as u32).saturating_sub(rx);
    let y0 = (top.floor() as u32).saturating_sub(ry);
    let x1 = (((left + bw).ceil() as u32) + rx).min(w);
    let y1 = (((top + bh).ceil() as u32) + ry).min(h);
    let (cols, rows) = (x1 - x0, y1 - y0);
    // Rows of the decoded image's full width: libjpeg widens the columns to its blocks.
    let stride = w as usize * 4;
    let mut data = vec![0u8; stride * rows as usize];
    // The last row of the file is decoded into this (the rows after the rectangle read).
    let mut spare = vec![0u8; stride];
    let mut msg = [0 as c_char; 200];
    let (mut got_x, mut got_cols, mut warnings, mut truncated) = (0, 0, 0, 0);
    // SAFETY: `encoded` is valid for its length; `data` holds `rows` rows of `stride` bytes,
    // `spare` one; the outputs and the message buffer are ours.
    let rc = unsafe {
        larder_jpeg_region(
            encoded.as_ptr(),
            encoded.len() as c_ulong,
            denom,
            x0,
            y0,
            cols,
            rows,
            data.as_mut_ptr(),
            stride,
            spare.as_mut_ptr(),
            &mut got_x,
            &mut got_cols,
            &mut warnings,
            &mut truncated,
            msg.as_mut_ptr(),
            msg.len(),
        )
    };
    match rc {
        OK => {}
        NOT_HERE => return Ok(None),
        _ => bail!("JPEG does not decode whole: {}", text(&msg)),
    }
    // As a whole decode: a file whose data ends early is missing rows (torchvision refuses it
    // too), whichever warning came first; other warnings leave it whole.
    if truncated != 0 || (warnings > 0 && text(&msg).to_ascii_lowercase().contains("premature end"))
    {
        bail!(
            "JPEG does not decode whole: its data ends before its image does ({})",
            text(&msg)
        );
    }
    // The rectangle's rows as an image of their own (got_cols wide from column got_x): its
    // edges are the image's where they meet them, so the resizer clamps windows as it would
    // on the whole image; elsewhere no window reaches them.
    let row = got_cols as usize * 4;
    for r in 1..rows as usize {
        data.copy_within(r * stride..r * stride + row, r * row);
    }
    data.truncate(rows as usize * row);
    let area = (left - got_x as f64, top - y0 as f64, bw, bh);
    let rgbx = resize_box_into(
        &data,
        (got_cols, rows),
        4,
        area,
        (crop, crop),
        resample,
        Vec::new(),
    )?;
    Ok(Some(Value::new(vec![3, crop, crop], rgbx_to_planes(&rgbx))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{FieldOp, Preprocess, Resize};

    /// A photo-like JPEG (smooth shapes, edges and noise) of w x h, quality 90, 4:2:0 (grey:
    /// one component).
    fn photo(w: u32, h: u32, grey: bool) -> Vec<u8> {
        let mut px = Vec::with_capacity((w * h * 3) as usize);
        let mut noise = 12345u32;
        for y in 0..h {
            for x in 0..w {
                noise = noise.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let n = (noise >> 24) as i32 % 24 - 12;
                let (fx, fy) = (x as f32 / w as f32, y as f32 / h as f32);
                let disc = ((fx - 0.4).powi(2) + (fy - 0.6).powi(2)) < 0.05;
                let r = (fx * 255.0) as i32 + n;
                let g = if disc { 220 } else { (fy * 200.0) as i32 } + n;
                let b = (((x / 7 + y / 5) % 2) * 180) as i32 + n / 2;
                px.extend([r, g, b].map(|v| v.clamp(0, 255) as u8));
            }
        }
        if grey {
            px = px.chunks_exact(3).map(|p| p[1]).collect();
        }
        let image = turbojpeg::Image {
            pixels: &px[..],
            width: w as usize,
            pitch: w as usize * if grey { 1 } else { 3 },
            height: h as usize,
            format: if grey {
                turbojpeg::PixelFormat::GRAY
            } else {
                turbojpeg::PixelFormat::RGB
            },
        };
        let mut c = turbojpeg::Compressor::new().unwrap();
        c.set_quality(90);
        c.set_subsamp(if grey {
            turbojpeg::Subsamp::Gray
        } else {
            turbojpeg::Subsamp::Sub2x2
        });
        c.compress_to_vec(image).unwrap()
    }

    fn kept(file: &[u8], keep_crop: Option<u32>) -> Value {
        let pre = Preprocess::Images {
            ops: vec![FieldOp::rgb()],
            resize: Resize {
                shorter: 256,
                max_size: None,
                square: false,
                keep_crop,
            },
        };
        let raw = vec![Value::new(vec![file.len() as u32], file.to_vec())];
        pre.apply(raw, &Default::default()).unwrap().remove(0)
    }

    /// The centered 224 x 224 of [3, H, W] planes, as the eval pipeline cuts it.
    fn center_crop(v: &Value) -> Vec<u8> {
        let (h, w) = (v.dims[1] as usize, v.dims[2] as usize);
        let (x, y) = (
            super::super::augment::center(w as u32, 224) as usize,
            super::super::augment::center(h as u32, 224) as usize,
        );
        let mut out = vec![];
        for c in 0..3 {
            for r in y..y + 224 {
                let at = c * h * w + r * w + x;
                out.extend_from_slice(&v.data[at..at + 224]);
            }
        }
        out
    }

    fn psnr(a: &[u8], b: &[u8]) -> f64 {
        let mse = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
            .sum::<f64>()
            / a.len() as f64;
        if mse == 0.0 {
            f64::INFINITY
        } else {
            10.0 * (255.0f64 * 255.0 / mse).log10()
        }
    }

    #[test]
    fn a_region_decode_gives_the_whole_decodes_crop_within_rounding() {
        // Landscape, portrait, odd sizes, and ones decoded at 1/2 and 1/4 of their size.
        for (w, h) in [
            (500, 375),
            (375, 500),
            (333, 517),
            (1000, 750),
            (2100, 1500),
        ] {
            let file = photo(w, h, false);
            // Through libjpeg's region decode, not the whole decode's fallback.
            let size = Resize {
                shorter: 256,
                max_size: None,
                square: false,
                keep_crop: None,
            }
            .size((w, h));
            let direct = kept_at_crop(&file, (w, h), size, 224, Resample::Linear, u64::MAX)
                .unwrap()
                .expect("a baseline YCbCr JPEG is decoded by region");
            let exact = center_crop(&kept(&file, None));
            let region = kept(&file, Some(224));
            assert_eq!(region.dims, vec![3, 224, 224]);
            assert_eq!(region.data, direct.data);
            let db = psnr(&exact, &region.data);
            let worst = exact
                .iter()
                .zip(&region.data)
                .map(|(&a, &b)| (a as i32 - b as i32).abs())
                .max()
                .unwrap();
            eprintln!("{w}x{h}: {db:.1} dB, worst pixel {worst}");
            assert!(db >= 45.0, "{w}x{h}: {db:.1} dB, worst pixel {worst}");
        }
    }

    #[test]
    fn what_libjpeg_does_not_crop_is_decoded_whole_and_kept_at_the_crop() {
        // One component (grey): decoded whole, then cut: exactly the exact path's eval crop.
        let file = photo(500, 375, true);
        let exact = center_crop(&kept(&file, None));
        let region = kept(&file, Some(224));
        assert_eq!(region.dims, vec![3, 224, 224]);
        assert_eq!(exact, region.data);
        // A file cut short, in the crop or below it, is refused, as a whole decode refuses it.
        let whole = photo(500, 375, false);
        for tenths in [5, 9] {
            let cut = &whole[..whole.len() * tenths / 10];
            let err = kept_at_crop(cut, (500, 375), (341, 256), 224, Resample::Linear, u64::MAX)
                .unwrap_err()
                .to_string();
            assert!(err.contains("does not decode whole"), "{tenths}/10: {err}");
        }
        // Portrait: the crop reads rows 185 to 514 of 700; cut at 85%, the file ends below it.
        let tall = photo(375, 700, false);
        let cut = &tall[..tall.len() * 85 / 100];
        let err = kept_at_crop(cut, (375, 700), (256, 477), 224, Resample::Linear, u64::MAX)
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not decode whole"), "{err}");
        // A crop larger than the size kept: the image is kept whole (the eval pipeline pads it).
        let file = photo(500, 375, false);
        assert_eq!(kept(&file, Some(300)).dims, kept(&file, None).dims);
    }
}
