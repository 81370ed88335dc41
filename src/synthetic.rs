//! Synthetic datasets: the ones `larder demo` serves and the tests check byte for byte (each
//! sample's bytes and label are a function of its index).

use anyhow::{Context, Result};
use std::path::Path;

/// Byte `offset` of synthetic sample `index`: every sample differs, and so does every byte.
pub fn sample_byte(index: u64, offset: usize) -> u8 {
    (index.wrapping_mul(131).wrapping_add(offset as u64 * 7) % 251) as u8
}

pub fn expected_sample(index: u64, len: usize) -> Vec<u8> {
    (0..len).map(|o| sample_byte(index, o)).collect()
}

pub fn expected_label(index: u64) -> i64 {
    (index % 10) as i64
}

/// Writes `n` synthetic uint8 samples of `shape` to `path` as datasets "images" and "labels".
pub fn make_dataset(path: &Path, n: u64, shape: &[usize]) -> Result<()> {
    let len: usize = shape.iter().product();
    let mut data = Vec::with_capacity(n as usize * len);
    for i in 0..n {
        data.extend((0..len).map(|o| sample_byte(i, o)));
    }
    let labels: Vec<i64> = (0..n).map(expected_label).collect();
    let mut full_shape = vec![n as usize];
    full_shape.extend_from_slice(shape);
    crate::source::write_hdf5(
        path,
        "images",
        &full_shape,
        &data,
        Some(("labels", &labels)),
    )
}

/// Writes a super-resolution set to `path`: uint8 low-res images "lr" [N, 3, 16, 16] and their
/// high-res targets "hr" [N, 3, 64, 64] (each lr pixel a 4x4 block of hr).
pub fn make_super_resolution(path: &Path, n: usize) -> Result<()> {
    let hr = ndarray::Array4::<u8>::from_shape_fn((n, 3, 64, 64), |(i, c, y, x)| {
        sample_byte(i as u64, c * 4096 + (y / 4) * 64 + x / 4)
    });
    let lr = ndarray::Array4::<u8>::from_shape_fn((n, 3, 16, 16), |(i, c, y, x)| {
        hr[[i, c, y * 4, x * 4]]
    });
    let file = hdf5::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    file.new_dataset_builder().with_data(&lr).create("lr")?;
    file.new_dataset_builder().with_data(&hr).create("hr")?;
    Ok(())
}

/// Writes a segmentation folder under `root`: `images/NNN.png` (RGB, of varying sizes) and
/// `masks/NNN.png` (palette PNGs whose indices are class ids 0..4).
pub fn make_segmentation(root: &Path, n: u32) -> Result<()> {
    for dir in ["images", "masks"] {
        std::fs::create_dir_all(root.join(dir))?;
    }
    for i in 0..n {
        let (w, h) = (48 + 4 * (i % 5), 40 + 2 * (i % 7));
        let class = |x: u32, y: u32| ((x / 12 + y / 10 + i) % 5) as u8;
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            let c = class(x, y);
            image::Rgb([c * 50, (x * 5) as u8, (y * 5) as u8])
        });
        img.save(root.join("images").join(format!("{i:03}.png")))?;
        let file = std::fs::File::create(root.join("masks").join(format!("{i:03}.png")))?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
        enc.set_color(png::ColorType::Indexed);
        enc.set_depth(png::BitDepth::Eight);
        enc.set_palette(
            (0..=255u8)
                .flat_map(|c| [c.wrapping_mul(50), 255 - c, 128])
                .collect::<Vec<_>>(),
        );
        let ids: Vec<u8> = (0..h)
            .flat_map(|y| (0..w).map(move |x| class(x, y)))
            .collect();
        enc.write_header()?.write_image_data(&ids)?;
    }
    Ok(())
}
