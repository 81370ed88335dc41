//! Turning a raw sample's fields into what the tiers keep: values of the dataset's fields.
//! HDF5 values are kept as stored; image files are decoded (each field by its own mode) and
//! resized once, together, as a spatial group (see `fields`). Cropping happens later, at batch
//! assembly, by each stream's pipeline (see `augment`), so the tiers keep what every crop needs.

use super::decode::{self, Out};
use super::planes::{resize_interleaved, resize_interleaved_into, rgbx_to_planes};
use crate::config::{ImageMode, Limits};
use crate::fields::{DType, FieldSpec, RawSample, Resample, Value};
use anyhow::{bail, ensure, Context, Result};
use image::GrayImage;
use std::cell::RefCell;

/// What happens to one raw field.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldOp {
    /// Kept as read.
    Keep,
    /// An image file, decoded by `mode`; its H and W are `scale` times the reference image's.
    Decode {
        mode: ImageMode,
        scale: u32,
        resample: Resample,
        /// Turned upright by the JPEG's EXIF orientation first (as Hugging Face `datasets`
        /// decodes; torchvision's ImageFolder does not).
        upright: bool,
    },
    /// A value stored as text or bytes, parsed into a typed one.
    Parse(Parse),
}

/// How a stored value is parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parse {
    /// A decimal integer as text (surrounding whitespace allowed: WebDataset's `.cls`, a
    /// label file), served as an int64 scalar.
    Int64Text,
}

impl Parse {
    /// The value `data` holds.
    pub fn apply(&self, data: &[u8]) -> Result<Value> {
        match self {
            Parse::Int64Text => {
                let text = std::str::from_utf8(data)
                    .ok()
                    .map(str::trim)
                    .filter(|t| t.len() <= 20)
                    .context("not a decimal integer (not short UTF-8 text)")?;
                let n: i64 = text
                    .parse()
                    .with_context(|| format!("{text:?} is not a decimal integer"))?;
                Ok(Value::int64(n))
            }
        }
    }
}

/// The size image folders keep their images at (the reference image's; paired ones at their
/// scale), torchvision's `Resize` rule: the shorter side to `shorter` and the longer one in
/// proportion, truncated, but at most `max_size`; or, `square`, `shorter` x `shorter`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Resize {
    /// 0: images are kept at their own size.
    pub shorter: u32,
    pub max_size: Option<u32>,
    pub square: bool,
    /// Kept at this centered crop of the resized image (an eval-only dataset's `crop`, with
    /// `decode = "region"`): of a dataset with one image field, an image at least that large.
    pub keep_crop: Option<u32>,
}

impl Resize {
    /// The (W, H) an image of (w, h) is kept at.
    pub fn size(&self, (w, h): (u32, u32)) -> (u32, u32) {
        let s = self.shorter;
        if s == 0 {
            return (w, h);
        }
        if self.square {
            return (s, s);
        }
        let (short, long) = (w.min(h), w.max(h));
        let (mut new_short, mut new_long) = (s, (s as u64 * long as u64 / short as u64) as u32);
        if let Some(max) = self.max_size {
            if new_long > max {
                new_short = ((max as u64 * new_short as u64) / new_long as u64).max(1) as u32;
                new_long = max;
            }
        }
        if w <= h {
            (new_short, new_long)
        } else {
            (new_long, new_short)
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Preprocess {
    /// The raw values already are the sample (HDF5).
    Identity,
    /// Image folders: the first decoded field is the reference, resized by `resize`; every
    /// decoded field is resized to the reference's size at its scale. Deterministic: same
    /// files, same bytes.
    Images { ops: Vec<FieldOp>, resize: Resize },
    /// Done where the samples are read (a reader process): the description it gave.
    Elsewhere(String),
}

impl FieldOp {
    /// An RGB image, the reference of its group (scale 1), resampled linearly.
    pub fn rgb() -> FieldOp {
        FieldOp::Decode {
            mode: ImageMode::Rgb,
            scale: 1,
            resample: Resample::Linear,
            upright: false,
        }
    }

    /// The field this op keeps from a raw field named `name`: images are [C, H, W] ([H, W] for
    /// index masks), H and W varying by sample unless `resize` makes them square.
    pub fn field(&self, name: &str, resize: &Resize) -> FieldSpec {
        let (mode, scale, resample) = match self {
            FieldOp::Decode {
                mode,
                scale,
                resample,
                ..
            } => (mode, scale, resample),
            FieldOp::Keep | FieldOp::Parse(Parse::Int64Text) => {
                return FieldSpec::fixed(name, DType::Int64, &[])
            }
        };
        let side = (resize.square && resize.shorter > 0).then_some(resize.shorter * scale);
        let mut dims = match mode {
            ImageMode::Rgb => vec![Some(3)],
            ImageMode::Gray => vec![Some(1)],
            ImageMode::Index => vec![],
        };
        dims.extend([side, side]);
        let mut f = FieldSpec::new(name, DType::Uint8, dims);
        f.resample = *resample;
        f
    }
}

impl Preprocess {
    /// Identifies the transformation, so the scratch tier can tell when it changes.
    pub fn describe(&self) -> String {
        match self {
            Preprocess::Elsewhere(described) => described.clone(),
            _ => format!("{self:?} decoder libjpeg-turbo 2, kept at the header's size"),
        }
    }

    /// The sample's values from its raw fields; an image over `limits.max_image_pixels` is
    /// refused from its header, before it is decoded.
    pub fn apply(&self, raw: RawSample, limits: &Limits) -> Result<Vec<Value>> {
        match self {
            Preprocess::Identity => Ok(raw),
            Preprocess::Images { ops, resize } => images(ops, resize, raw, limits),
            Preprocess::Elsewhere(_) => {
                bail!("this dataset's samples are preprocessed by its reader")
            }
        }
    }
}

/// A sample's record from its raw fields: preprocessed, encoded by `schema`, within the limits
/// (its files as read, and its record, at most `limits.max_sample_bytes`).
pub fn prepare(
    preprocess: &Preprocess,
    schema: &crate::fields::Schema,
    limits: &Limits,
    raw: RawSample,
) -> Result<Vec<u8>> {
    let max = limits.max_sample_bytes;
    let read = crate::fields::raw_bytes(&raw);
    ensure!(
        read <= max,
        "its files take {read} bytes, over the {max} a sample may (limits.max_sample_bytes)"
    );
    let values = preprocess.apply(raw, limits)?;
    let record = schema.encode(&values)?;
    ensure!(
        record.len() as u64 <= max,
        "it takes {} bytes once decoded, over the {max} a sample may (limits.max_sample_bytes)",
        record.len()
    );
    Ok(record)
}

/// The largest buffer a preprocessing thread keeps between images (a 2,000 x 2,000 RGBX image
/// is 16 MB; larger ones are allocated and freed each time, as before).
const KEPT_BUFFER_MAX: usize = 16 << 20;

thread_local! {
    /// This thread's decoded and resized pixels, their allocations kept between images.
    static BUFFERS: RefCell<(Vec<u8>, Vec<u8>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

fn images(ops: &[FieldOp], resize: &Resize, raw: RawSample, limits: &Limits) -> Result<Vec<Value>> {
    ensure!(
        raw.len() == ops.len(),
        "{} raw fields for {} ops",
        raw.len(),
        ops.len()
    );
    // The reference's size as kept, (W, H), once its file is read.
    let mut kept: Option<(u32, u32)> = None;
    // Kept at the eval crop: a dataset of one image field (a paired field would need the same
    // cut at its scale), decoded only over the crop where the file allows.
    let decoded_fields = ops
        .iter()
        .filter(|o| matches!(o, FieldOp::Decode { .. }))
        .count();
    let keep_crop = resize.keep_crop.filter(|_| decoded_fields == 1);
    let mut out = Vec::with_capacity(raw.len());
    for (k, (op, value)) in ops.iter().zip(raw).enumerate() {
        let (mode, scale, resample, upright) = match op {
            FieldOp::Keep => {
                out.push(value);
                continue;
            }
            FieldOp::Parse(parse) => {
                out.push(parse.apply(&value.data)?);
                continue;
            }
            FieldOp::Decode {
                mode,
                scale,
                resample,
                upright,
            } => (mode, scale, resample, *upright),
        };
        let s = *scale;
        let decoded = (|| -> Result<Value> {
            let max_pixels = limits.max_image_pixels;
            if *mode == ImageMode::Index {
                let ids = decode_index(&value.data, max_pixels)?;
                let size = *kept.get_or_insert_with(|| resize.size(ids.dimensions()));
                let (w, h) = scaled(size, s)?;
                decode::check_pixels(w, h, max_pixels).context("resized to the size kept")?;
                let px = resize_interleaved(ids.as_raw(), ids.dimensions(), 1, (w, h), *resample)?;
                return Ok(Value::new(vec![h, w], px));
            }
            let grey = *mode == ImageMode::Gray;
            if let (Some(k), false, false, 1) = (keep_crop, grey, upright, s) {
                if let Some(full) = decode::jpeg_size(&value.data)? {
                    check_pixels_of(full, max_pixels)?;
                    let size = resize.size(full);
                    kept = Some(size);
                    if let Some(v) = super::region::kept_at_crop(
                        &value.data,
                        full,
                        size,
                        k,
                        *resample,
                        max_pixels,
                    )? {
                        return Ok(v);
                    }
                }
            }
            // Decoded at 1/2, 1/4 or 1/8 when that still leaves enough pixels for the size
            // kept (the reference's size is known from the file's header). The size kept is
            // the one the file's own (W, H) gives, as torchvision computes it, never the
            // scaled decode's (250x188 would give 212x160 where 500x375 gives 213x160).
            let known = kept;
            let header = std::cell::Cell::new(None);
            let at_least = |w, h| {
                header.set(Some((w, h)));
                let (w, h) = known.unwrap_or_else(|| resize.size((w, h)));
                (resize.shorter > 0).then_some(w.saturating_mul(s).min(h.saturating_mul(s)))
            };
            // RGB as 4 bytes a pixel, the layout the resizer handles fastest, through this
            // thread's buffers (only the planes kept are a new allocation).
            let out = if grey { Out::Grey } else { Out::Rgbx };
            BUFFERS.with(|cell| {
                let (decoded, resized) = &mut *cell.borrow_mut();
                let buf = std::mem::take(decoded);
                let px = decode::decode_into(&value.data, out, max_pixels, at_least, buf)?;
                let (mut w, mut h, c) = (px.width, px.height, px.channels);
                *decoded = px.data;
                let o = if upright {
                    super::exif::orientation(&value.data)
                } else {
                    1
                };
                if o > 1 {
                    let (turned, size) = super::exif::upright(decoded, (w, h), c as usize, o);
                    *decoded = turned;
                    (w, h) = size;
                }
                let pixels: &[u8] = decoded;
                ensure!(w > 0 && h > 0, "image is empty");
                let full = match header.get() {
                    Some((fw, fh)) if o > 4 => (fh, fw),
                    Some(wh) => wh,
                    None => (w, h),
                };
                let size = *kept.get_or_insert_with(|| resize.size(full));
                let (nw, nh) = scaled(size, s)?;
                decode::check_pixels(nw, nh, max_pixels).context("resized to the size kept")?;
                let buf = std::mem::take(resized);
                let buf = resize_interleaved_into(pixels, (w, h), c, (nw, nh), *resample, buf)?;
                *resized = buf;
                // Kept at the eval crop: its centered crop x crop (an image smaller than that
                // is kept whole, and padded where it is served, as before).
                let (done, nw, nh) = match keep_crop {
                    Some(k) if nw >= k && nh >= k => {
                        let (x, y) = (
                            super::augment::center(nw, k) as usize,
                            super::augment::center(nh, k) as usize,
                        );
                        let (row, cc) = (nw as usize * c as usize, c as usize);
                        let cut: Vec<u8> = (y..y + k as usize)
                            .flat_map(|r| {
                                &resized[r * row + x * cc..r * row + (x + k as usize) * cc]
                            })
                            .copied()
                            .collect();
                        (std::borrow::Cow::Owned(cut), k, k)
                    }
                    _ => (std::borrow::Cow::Borrowed(&resized[..]), nw, nh),
                };
                // RGBX to three planes; grey is one plane as it is.
                let value = if c == 4 {
                    Value::new(vec![3, nh, nw], rgbx_to_planes(&done))
                } else {
                    Value::new(vec![c, nh, nw], done.to_vec())
                };
                drop(done);
                // A huge image's buffers are not kept for the thread's life (outside the budget).
                for buf in [decoded, resized] {
                    if buf.capacity() > KEPT_BUFFER_MAX {
                        *buf = Vec::new();
                    }
                }
                Ok(value)
            })
        })()
        .with_context(|| format!("decoding image field {k}"))?;
        out.push(decoded);
    }
    Ok(out)
}

/// Refuses an image whose header's (W, H) is over `max_pixels`.
fn check_pixels_of((w, h): (u32, u32), max_pixels: u64) -> Result<()> {
    decode::check_pixels(w, h, max_pixels)
}

/// (W, H) times `scale`, checked: a paired field's size.
fn scaled((w, h): (u32, u32), scale: u32) -> Result<(u32, u32)> {
    match (w.checked_mul(scale), h.checked_mul(scale)) {
        (Some(w), Some(h)) => Ok((w, h)),
        _ => bail!("{w} x {h} at scale {scale} is too large"),
    }
}

/// A mask's class ids: the palette indices of a palette PNG, or the values of an 8-bit (or
/// narrower) greyscale PNG. Never converted through colour.
fn decode_index(encoded: &[u8], max_pixels: u64) -> Result<GrayImage> {
    ensure!(
        encoded.starts_with(b"\x89PNG"),
        "index masks must be PNG files (palette or greyscale); JPEG would blend class ids"
    );
    let mut decoder = png::Decoder::new(std::io::Cursor::new(encoded));
    decoder.set_transformations(png::Transformations::IDENTITY);
    let mut reader = decoder.read_info()?;
    decode::check_pixels(reader.info().width, reader.info().height, max_pixels)?;
    let mut buf = vec![0; reader.output_buffer_size().context("PNG too large")?];
    let info = reader.next_frame(&mut buf)?;
    match info.color_type {
        png::ColorType::Indexed | png::ColorType::Grayscale => {}
        other => bail!("index masks must be palette or greyscale PNGs, this one is {other:?}"),
    }
    let depth = info.bit_depth as u32;
    ensure!(
        depth <= 8,
        "index masks of {depth} bits per pixel are not supported (at most 8)"
    );
    let (w, h) = (info.width, info.height);
    let mut ids = Vec::with_capacity(w as usize * h as usize);
    for row in buf.chunks(info.line_size).take(h as usize) {
        if depth == 8 {
            ids.extend_from_slice(&row[..w as usize]);
            continue;
        }
        let mask = (1u16 << depth) as u8 - 1;
        for x in 0..w {
            let bit = x * depth;
            let shift = 8 - depth - bit % 8;
            ids.push((row[(bit / 8) as usize] >> shift) & mask);
        }
    }
    GrayImage::from_raw(w, h, ids).context("mask size")
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::RgbImage;

    #[test]
    fn a_jpeg_decoded_at_half_is_kept_at_the_size_its_header_gives() {
        let px: Vec<u8> = (0..500 * 375 * 3).map(|i| (i % 251) as u8).collect();
        let image = turbojpeg::Image {
            pixels: &px[..],
            width: 500,
            pitch: 1500,
            height: 375,
            format: turbojpeg::PixelFormat::RGB,
        };
        let file = turbojpeg::compress(image, 90, turbojpeg::Subsamp::Sub2x2)
            .unwrap()
            .to_vec();
        for (shorter, want) in [
            (160, [3, 160, 213]),
            (90, [3, 90, 120]),
            (256, [3, 256, 341]),
        ] {
            let pre = Preprocess::Images {
                ops: vec![FieldOp::rgb()],
                resize: Resize {
                    shorter,
                    max_size: None,
                    square: false,
                    keep_crop: None,
                },
            };
            let raw = vec![Value::new(vec![file.len() as u32], file.clone())];
            // torchvision's Resize(shorter) of 500x375: the longer side 500 * shorter / 375.
            let kept = pre.apply(raw, &Default::default()).unwrap().remove(0);
            assert_eq!(kept.dims, want, "resize {shorter}");
        }
    }

    fn png(w: u32, h: u32, f: impl Fn(u32, u32) -> [u8; 3]) -> Vec<u8> {
        let img = RgbImage::from_fn(w, h, |x, y| image::Rgb(f(x, y)));
        let mut out = std::io::Cursor::new(vec![]);
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    /// A palette PNG whose palette maps index i to a colour that is not i.
    fn palette_png(w: u32, h: u32, ids: &[u8]) -> Vec<u8> {
        let mut out = vec![];
        let mut enc = png::Encoder::new(&mut out, w, h);
        enc.set_color(png::ColorType::Indexed);
        enc.set_depth(png::BitDepth::Eight);
        enc.set_palette(
            (0..=255u8)
                .flat_map(|i| [255 - i, i / 2, 7])
                .collect::<Vec<_>>(),
        );
        enc.write_header().unwrap().write_image_data(ids).unwrap();
        out
    }

    fn raw(files: &[Vec<u8>]) -> RawSample {
        files
            .iter()
            .map(|f| Value::new(vec![f.len() as u32], f.clone()))
            .collect()
    }

    fn shorter(side: u32) -> Resize {
        Resize {
            shorter: side,
            max_size: None,
            square: false,
            keep_crop: None,
        }
    }

    #[test]
    fn resizing_follows_torchvision() {
        assert_eq!(shorter(256).size((500, 375)), (341, 256));
        assert_eq!(shorter(256).size((375, 500)), (256, 341));
        assert_eq!(shorter(0).size((500, 375)), (500, 375));
        let capped = Resize {
            max_size: Some(300),
            ..shorter(256)
        };
        assert_eq!(capped.size((1000, 250)), (300, 75));
        let square = Resize {
            square: true,
            ..shorter(64)
        };
        assert_eq!(square.size((500, 375)), (64, 64));
    }

    #[test]
    fn images_are_kept_resized_as_chw_uint8() {
        // 40x20: left half red, right half blue.
        let file = png(
            40,
            20,
            |x, _| if x < 20 { [255, 0, 0] } else { [0, 0, 255] },
        );
        let p = Preprocess::Images {
            ops: vec![FieldOp::rgb(), FieldOp::Keep],
            resize: shorter(10),
        };
        let mut input = raw(&[file]);
        input.push(Value::int64(4));
        let out = p.apply(input.clone(), &Limits::default()).unwrap();
        assert_eq!(out[0].dims, vec![3, 10, 20]);
        assert_eq!(out[1], Value::int64(4));
        let (r, b) = (&out[0].data[0..200], &out[0].data[400..600]);
        assert_eq!((r[0], b[0]), (255, 0), "top-left is red");
        assert_eq!((r[19], b[19]), (0, 255), "top-right is blue");
        assert_eq!(
            out,
            p.apply(input, &Limits::default()).unwrap(),
            "deterministic"
        );
        assert_eq!(
            FieldOp::rgb().field("image", &shorter(256)).shape,
            vec![Some(3), None, None]
        );
        let square = Resize {
            square: true,
            ..shorter(8)
        };
        assert_eq!(
            FieldOp::rgb().field("image", &square),
            FieldSpec::fixed("image", DType::Uint8, &[3, 8, 8])
        );
    }

    #[test]
    fn masks_keep_class_ids_and_follow_the_image() {
        // A 8x4 image and its palette mask: ids 0, 1, 2 in vertical stripes.
        let ids: Vec<u8> = (0..4).flat_map(|_| (0..8u8).map(|x| x / 3)).collect();
        let mask = palette_png(8, 4, &ids);
        let image = png(8, 4, |x, _| [x as u8 * 30, 0, 0]);
        let index = FieldOp::Decode {
            mode: ImageMode::Index,
            scale: 1,
            resample: Resample::Nearest,
            upright: false,
        };
        let p = Preprocess::Images {
            ops: vec![FieldOp::rgb(), index.clone()],
            resize: shorter(2),
        };
        let out = p.apply(raw(&[image, mask]), &Limits::default()).unwrap();
        assert_eq!(out[1].dims, vec![2, 4]);
        assert!(
            out[1].data.iter().all(|&v| v <= 2),
            "ids, not colours: {:?}",
            out[1].data
        );
        // Unresized, the mask is its ids exactly.
        let p = Preprocess::Images {
            ops: vec![index],
            resize: shorter(0),
        };
        assert_eq!(
            p.apply(raw(&[palette_png(8, 4, &ids)]), &Limits::default())
                .unwrap()[0]
                .data,
            ids
        );
        let err = format!(
            "{:#}",
            p.apply(raw(&[png(2, 2, |_, _| [0, 0, 0])]), &Limits::default())
                .unwrap_err()
        );
        assert!(err.contains("palette or greyscale"), "{err}");
    }

    #[test]
    fn paired_fields_are_kept_at_their_scale() {
        let lr = png(8, 4, |x, _| [x as u8, 0, 0]);
        let hr = png(16, 8, |x, _| [x as u8, 0, 0]);
        let p = Preprocess::Images {
            ops: vec![
                FieldOp::rgb(),
                FieldOp::Decode {
                    mode: ImageMode::Rgb,
                    scale: 2,
                    resample: Resample::Linear,
                    upright: false,
                },
            ],
            resize: shorter(0),
        };
        let out = p.apply(raw(&[lr, hr]), &Limits::default()).unwrap();
        assert_eq!(out[0].dims, vec![3, 4, 8]);
        assert_eq!(out[1].dims, vec![3, 8, 16]);
        assert_eq!(&out[1].data[..4], &[0, 1, 2, 3]);
    }

    #[test]
    fn bad_input_is_an_error() {
        let p = Preprocess::Images {
            ops: vec![FieldOp::rgb()],
            resize: shorter(10),
        };
        let err = format!(
            "{:#}",
            p.apply(raw(&[b"not an image".to_vec()]), &Limits::default())
                .unwrap_err()
        );
        assert!(err.contains("decoding image"), "{err}");
    }

    #[test]
    fn parse_steps_read_text_as_typed_values() {
        let resize = Resize {
            shorter: 0,
            max_size: None,
            square: false,
            keep_crop: None,
        };
        let p = Preprocess::Images {
            ops: vec![FieldOp::Keep, FieldOp::Parse(Parse::Int64Text)],
            resize,
        };
        let raw = vec![Value::int64(3), Value::new(vec![4], b" 17\n".to_vec())];
        let got = p.apply(raw, &Limits::default()).unwrap();
        assert_eq!(got, vec![Value::int64(3), Value::int64(17)]);
        assert_eq!(
            FieldOp::Parse(Parse::Int64Text).field("cls", &resize),
            FieldSpec::fixed("cls", DType::Int64, &[])
        );
        for bad in [&b"x1"[..], b"", b"\xff", b"99999999999999999999999"] {
            let raw = vec![
                Value::int64(0),
                Value::new(vec![bad.len() as u32], bad.to_vec()),
            ];
            assert!(p.apply(raw, &Limits::default()).is_err(), "{bad:?}");
        }
    }
}
