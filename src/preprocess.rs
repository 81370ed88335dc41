//! Turning a raw sample's fields into what clients train on: values of the dataset's fields.
//! HDF5 values are served as stored; image files are decoded (each field by its own mode) and
//! resized and cropped together, as a spatial group (see `fields`).

use crate::config::ImageMode;
use crate::fields::{DType, FieldSpec, Resample, Value};
use crate::source::RawSample;
use anyhow::{bail, ensure, Context, Result};
use image::imageops::{self, FilterType};
use image::{GrayImage, RgbImage};

/// What happens to one raw field.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldOp {
    /// Served as read.
    Keep,
    /// An image file, decoded by `mode`; its H and W are `scale` times the reference image's.
    Decode {
        mode: ImageMode,
        scale: u32,
        resample: Resample,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub enum Preprocess {
    /// The raw values already are the sample (HDF5).
    Identity,
    /// Image folders: the first decoded field is the reference; its shorter side is resized to
    /// `resize` (0: kept) and its center `crop` x `crop` kept (0: not cropped); every decoded
    /// field gets the same geometry at its scale. Deterministic: same files, same bytes.
    Images {
        ops: Vec<FieldOp>,
        resize: u32,
        crop: u32,
    },
}

impl FieldOp {
    /// An RGB image, the reference of its group (scale 1), resampled linearly.
    pub fn rgb() -> FieldOp {
        FieldOp::Decode {
            mode: ImageMode::Rgb,
            scale: 1,
            resample: Resample::Linear,
        }
    }

    /// The field this op makes from a raw field named `name`.
    pub fn field(&self, name: &str, crop: u32) -> FieldSpec {
        let FieldOp::Decode {
            mode,
            scale,
            resample,
        } = self
        else {
            return FieldSpec::fixed(name, DType::Int64, &[]);
        };
        let side = (crop > 0).then_some(crop * scale);
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
        format!("{self:?}")
    }

    pub fn apply(&self, raw: RawSample) -> Result<Vec<Value>> {
        match self {
            Preprocess::Identity => Ok(raw),
            Preprocess::Images { ops, resize, crop } => images(ops, *resize, *crop, raw),
        }
    }
}

/// Where a sample's fields are cut: the reference's size after resizing (W, H) and the box kept
/// (x, y, w, h), both at scale 1.
type Geometry = ((u32, u32), (u32, u32, u32, u32));

/// A decoded image: RGB, or one channel (greyscale, or class ids).
enum Decoded {
    Rgb(RgbImage),
    Luma(GrayImage),
}

impl Decoded {
    fn dimensions(&self) -> (u32, u32) {
        match self {
            Decoded::Rgb(i) => i.dimensions(),
            Decoded::Luma(i) => i.dimensions(),
        }
    }
}

/// Resized to (w, h), then the box (x, y, cw, ch) kept.
fn transform<P>(
    img: &image::ImageBuffer<P, Vec<u8>>,
    (w, h): (u32, u32),
    (x, y, cw, ch): (u32, u32, u32, u32),
    filter: FilterType,
) -> image::ImageBuffer<P, Vec<u8>>
where
    P: image::Pixel<Subpixel = u8> + 'static,
{
    let resized;
    let src = if img.dimensions() == (w, h) {
        img
    } else {
        resized = imageops::resize(img, w, h, filter);
        &resized
    };
    if (x, y, cw, ch) == (0, 0, w, h) {
        return src.clone();
    }
    imageops::crop_imm(src, x, y, cw, ch).to_image()
}

fn images(ops: &[FieldOp], resize: u32, crop: u32, raw: RawSample) -> Result<Vec<Value>> {
    ensure!(
        raw.len() == ops.len(),
        "{} raw fields for {} ops",
        raw.len(),
        ops.len()
    );
    let mut geometry: Option<Geometry> = None;
    let mut out = Vec::with_capacity(raw.len());
    for (k, (op, value)) in ops.iter().zip(raw).enumerate() {
        let FieldOp::Decode {
            mode,
            scale,
            resample,
        } = op
        else {
            out.push(value);
            continue;
        };
        let img =
            decode(&value.data, *mode).with_context(|| format!("decoding image field {k}"))?;
        let (w, h) = img.dimensions();
        ensure!(w > 0 && h > 0, "image is empty");
        // The reference (the first image) sets the geometry; the others follow at their scale.
        let ((nw, nh), (x, y, cw, ch)) = *geometry.get_or_insert_with(|| {
            let (nw, nh) = if resize == 0 {
                (w, h)
            } else if w <= h {
                (
                    resize,
                    ((h as f64 * resize as f64 / w as f64).round() as u32).max(resize),
                )
            } else {
                (
                    ((w as f64 * resize as f64 / h as f64).round() as u32).max(resize),
                    resize,
                )
            };
            let (cw, ch) = if crop == 0 { (nw, nh) } else { (crop, crop) };
            (
                (nw, nh),
                (nw.saturating_sub(cw) / 2, nh.saturating_sub(ch) / 2, cw, ch),
            )
        });
        ensure!(
            cw <= nw && ch <= nh,
            "image of {w}x{h} is smaller than the {crop}x{crop} crop (set resize, or a smaller crop)"
        );
        let s = *scale;
        let size = (nw * s, nh * s);
        let cut = (x * s, y * s, cw * s, ch * s);
        let filter = match resample {
            Resample::Nearest => FilterType::Nearest,
            Resample::Linear => FilterType::Triangle,
        };
        out.push(match (img, mode) {
            (Decoded::Rgb(img), _) => {
                let img = transform(&img, size, cut, filter);
                Value::new(vec![3, cut.3, cut.2], planar(&img))
            }
            (Decoded::Luma(img), ImageMode::Index) => {
                let img = transform(&img, size, cut, filter);
                Value::new(vec![cut.3, cut.2], img.into_raw())
            }
            (Decoded::Luma(img), _) => {
                let img = transform(&img, size, cut, filter);
                Value::new(vec![1, cut.3, cut.2], img.into_raw())
            }
        });
    }
    Ok(out)
}

/// RGB pixels as planes: [3, H, W].
fn planar(img: &RgbImage) -> Vec<u8> {
    let plane = (img.width() * img.height()) as usize;
    let mut chw = vec![0u8; 3 * plane];
    let (r, rest) = chw.split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    for (i, px) in img.as_raw().chunks_exact(3).enumerate() {
        r[i] = px[0];
        g[i] = px[1];
        b[i] = px[2];
    }
    chw
}

fn decode(encoded: &[u8], mode: ImageMode) -> Result<Decoded> {
    Ok(match mode {
        ImageMode::Rgb => Decoded::Rgb(image::load_from_memory(encoded)?.to_rgb8()),
        ImageMode::Gray => Decoded::Luma(image::load_from_memory(encoded)?.to_luma8()),
        ImageMode::Index => Decoded::Luma(decode_index(encoded)?),
    })
}

/// A mask's class ids: the palette indices of a palette PNG, or the values of an 8-bit (or
/// narrower) greyscale PNG. Never converted through colour.
fn decode_index(encoded: &[u8]) -> Result<GrayImage> {
    ensure!(
        encoded.starts_with(b"\x89PNG"),
        "index masks must be PNG files (palette or greyscale); JPEG would blend class ids"
    );
    let mut decoder = png::Decoder::new(std::io::Cursor::new(encoded));
    decoder.set_transformations(png::Transformations::IDENTITY);
    let mut reader = decoder.read_info()?;
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
    let mut ids = Vec::with_capacity((w * h) as usize);
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

    fn rgb() -> FieldOp {
        FieldOp::rgb()
    }

    #[test]
    fn images_become_center_cropped_chw_uint8() {
        // 40x20: left half red, right half blue; a green column in the middle.
        let file = png(40, 20, |x, _| match x {
            20 => [0, 255, 0],
            x if x < 20 => [255, 0, 0],
            _ => [0, 0, 255],
        });
        let p = Preprocess::Images {
            ops: vec![rgb(), FieldOp::Keep],
            resize: 10,
            crop: 8,
        };
        let mut input = raw(&[file]);
        input.push(Value::int64(4));
        let out = p.apply(input.clone()).unwrap();
        assert_eq!(out[0].dims, vec![3, 8, 8]);
        assert_eq!(out[1], Value::int64(4));
        let out = &out[0].data;
        // Resized to 20x10, cropped to columns 6..14, rows 1..9: left of center is red.
        let (r, b) = (&out[0..64], &out[128..192]);
        assert_eq!((r[0], b[0]), (255, 0), "top-left is red");
        assert_eq!((r[7], b[7]), (0, 255), "top-right is blue");
        assert_eq!(out, &p.apply(input).unwrap()[0].data, "deterministic");
        assert_eq!(
            rgb().field("image", 8),
            FieldSpec::fixed("image", DType::Uint8, &[3, 8, 8])
        );
        assert_eq!(rgb().field("image", 0).shape, vec![Some(3), None, None]);
    }

    #[test]
    fn without_a_crop_images_keep_their_aspect_ratio() {
        let p = Preprocess::Images {
            ops: vec![rgb()],
            resize: 10,
            crop: 0,
        };
        let out = p.apply(raw(&[png(40, 20, |_, _| [1, 2, 3])])).unwrap();
        assert_eq!(out[0].dims, vec![3, 10, 20]);
        assert!(out[0].data[..200].iter().all(|&v| v == 1));
    }

    #[test]
    fn masks_keep_class_ids_and_follow_the_image() {
        // A 8x4 image and its palette mask: ids 0, 1, 2 in vertical stripes.
        let ids: Vec<u8> = (0..4).flat_map(|_| (0..8u8).map(|x| x / 3)).collect();
        let mask = palette_png(8, 4, &ids);
        let image = png(8, 4, |x, _| [x as u8 * 30, 0, 0]);
        let p = Preprocess::Images {
            ops: vec![
                rgb(),
                FieldOp::Decode {
                    mode: ImageMode::Index,
                    scale: 1,
                    resample: Resample::Nearest,
                },
            ],
            resize: 2,
            crop: 2,
        };
        let out = p.apply(raw(&[image, mask])).unwrap();
        assert_eq!(out[1].dims, vec![2, 2]);
        assert!(
            out[1].data.iter().all(|&v| v <= 2),
            "ids, not colours: {:?}",
            out[1].data
        );
        // Unresized, the mask is its ids exactly.
        let p = Preprocess::Images {
            ops: vec![FieldOp::Decode {
                mode: ImageMode::Index,
                scale: 1,
                resample: Resample::Nearest,
            }],
            resize: 0,
            crop: 0,
        };
        assert_eq!(
            p.apply(raw(&[palette_png(8, 4, &ids)])).unwrap()[0].data,
            ids
        );
        let err = format!(
            "{:#}",
            p.apply(raw(&[png(2, 2, |_, _| [0, 0, 0])])).unwrap_err()
        );
        assert!(err.contains("palette or greyscale"), "{err}");
    }

    #[test]
    fn paired_fields_are_cut_at_their_scale() {
        let lr = png(8, 4, |x, _| [x as u8, 0, 0]);
        let hr = png(16, 8, |x, _| [x as u8, 0, 0]);
        let p = Preprocess::Images {
            ops: vec![
                rgb(),
                FieldOp::Decode {
                    mode: ImageMode::Rgb,
                    scale: 2,
                    resample: Resample::Linear,
                },
            ],
            resize: 0,
            crop: 4,
        };
        let out = p.apply(raw(&[lr, hr])).unwrap();
        assert_eq!(out[0].dims, vec![3, 4, 4]);
        assert_eq!(out[1].dims, vec![3, 8, 8]);
        assert_eq!(
            &out[0].data[..4],
            &[2, 3, 4, 5],
            "columns 2..6 of the low-res image"
        );
        assert_eq!(
            &out[1].data[..8],
            &[4, 5, 6, 7, 8, 9, 10, 11],
            "columns 4..12 of the high-res one"
        );
    }

    #[test]
    fn bad_input_is_an_error() {
        let p = Preprocess::Images {
            ops: vec![rgb()],
            resize: 10,
            crop: 8,
        };
        let err = format!(
            "{:#}",
            p.apply(raw(&[b"not an image".to_vec()])).unwrap_err()
        );
        assert!(err.contains("decoding image"), "{err}");
        let small = Preprocess::Images {
            ops: vec![rgb()],
            resize: 0,
            crop: 8,
        };
        let err = format!(
            "{:#}",
            small.apply(raw(&[png(4, 4, |_, _| [0; 3])])).unwrap_err()
        );
        assert!(err.contains("smaller than the 8x8 crop"), "{err}");
    }
}
