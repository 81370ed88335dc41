//! Turning raw samples into what clients train on: uint8 tensors of one fixed shape.

use anyhow::{ensure, Context, Result};
use image::imageops::{self, FilterType};

#[derive(Debug, Clone, PartialEq)]
pub enum Preprocess {
    /// The raw bytes already are the sample (HDF5 uint8 arrays of this shape).
    Identity { shape: Vec<u32> },
    /// Decode a JPEG/PNG, resize so the shorter side is `resize`, keep the center `crop` x `crop`,
    /// lay out as RGB uint8 [3, crop, crop]. Deterministic: same file, same bytes.
    Image { resize: u32, crop: u32 },
}

impl Preprocess {
    /// Shape of one preprocessed sample.
    pub fn shape(&self) -> Vec<u32> {
        match self {
            Preprocess::Identity { shape } => shape.clone(),
            Preprocess::Image { crop, .. } => vec![3, *crop, *crop],
        }
    }

    pub fn sample_bytes(&self) -> u64 {
        self.shape().iter().map(|&d| d as u64).product()
    }

    /// Identifies the transformation, so the scratch tier can tell when it changes.
    pub fn describe(&self) -> String {
        format!("{self:?}")
    }

    pub fn apply(&self, raw: Vec<u8>) -> Result<Vec<u8>> {
        match self {
            Preprocess::Identity { .. } => {
                ensure!(
                    raw.len() as u64 == self.sample_bytes(),
                    "raw sample has {} bytes, expected {}",
                    raw.len(),
                    self.sample_bytes()
                );
                Ok(raw)
            }
            Preprocess::Image { resize, crop } => decode_resize_crop(&raw, *resize, *crop),
        }
    }
}

fn decode_resize_crop(encoded: &[u8], resize: u32, crop: u32) -> Result<Vec<u8>> {
    let img = image::load_from_memory(encoded)
        .context("decoding image")?
        .to_rgb8();
    let (w, h) = img.dimensions();
    ensure!(w > 0 && h > 0, "image is empty");
    let scale = resize as f64 / w.min(h) as f64;
    let (nw, nh) = if w <= h {
        (resize, ((h as f64 * scale).round() as u32).max(resize))
    } else {
        (((w as f64 * scale).round() as u32).max(resize), resize)
    };
    let resized = imageops::resize(&img, nw, nh, FilterType::Triangle);
    let (x, y) = ((nw - crop) / 2, (nh - crop) / 2);
    let cropped = imageops::crop_imm(&resized, x, y, crop, crop).to_image();
    let plane = (crop * crop) as usize;
    let mut chw = vec![0u8; 3 * plane];
    for (i, px) in cropped.pixels().enumerate() {
        for c in 0..3 {
            chw[c * plane + i] = px.0[c];
        }
    }
    Ok(chw)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32, f: impl Fn(u32, u32) -> [u8; 3]) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb(f(x, y)));
        let mut out = std::io::Cursor::new(vec![]);
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    #[test]
    fn images_become_center_cropped_chw_uint8() {
        // 40x20: left half red, right half blue; a green column in the middle.
        let raw = png(40, 20, |x, _| match x {
            20 => [0, 255, 0],
            x if x < 20 => [255, 0, 0],
            _ => [0, 0, 255],
        });
        let p = Preprocess::Image {
            resize: 10,
            crop: 8,
        };
        let out = p.apply(raw.clone()).unwrap();
        assert_eq!(out.len(), 3 * 8 * 8);
        assert_eq!(p.shape(), vec![3, 8, 8]);
        // Resized to 20x10, cropped to columns 6..14, rows 1..9: left of center is red.
        let (r, b) = (&out[0..64], &out[128..192]);
        assert_eq!((r[0], b[0]), (255, 0), "top-left is red");
        assert_eq!((r[7], b[7]), (0, 255), "top-right is blue");
        assert_eq!(out, p.apply(raw).unwrap(), "deterministic");
    }

    #[test]
    fn bad_input_is_an_error() {
        let p = Preprocess::Image {
            resize: 10,
            crop: 8,
        };
        let err = format!("{:#}", p.apply(b"not an image".to_vec()).unwrap_err());
        assert!(err.contains("decoding image"), "{err}");
        let id = Preprocess::Identity { shape: vec![2, 2] };
        assert!(id.apply(vec![1, 2, 3]).is_err());
        assert_eq!(id.apply(vec![1, 2, 3, 4]).unwrap(), vec![1, 2, 3, 4]);
    }
}
