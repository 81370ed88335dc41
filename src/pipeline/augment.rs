//! The geometry of each served sample, chosen at batch assembly: the eval pipeline cuts the
//! center (no randomness), the train pipeline a random box (random-resized-crop, or a random
//! crop of the padded image) flipped half of the time. Parameters come from (seed, epoch, sample
//! id) alone, so the same epoch replayed or resumed on any number of ranks and workers gives the
//! same bytes, and the next epoch gives new ones. The box is drawn in the reference field's
//! pixels and applied to every field of its spatial group at that field's scale (see `fields`).
//! Only crop, scale and flip happen here, on the stored dtype: colour and noise need float and
//! belong on the GPU.

use super::planes::{self, BoxI};
use crate::fields::{FieldSpec, Resample, Schema};
use anyhow::{bail, ensure, Result};

/// How a stream's box is chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum Crop {
    /// The center, of the output's size; zeros around an image smaller than that.
    Center,
    /// A box of `scale` (a fraction of the area) and `ratio` (width / height, drawn on a log
    /// scale), resized to the output, as torchvision's `RandomResizedCrop`.
    RandomResized {
        scale: (f64, f64),
        ratio: (f64, f64),
    },
    /// A box of the output's size anywhere in the image padded by `padding` zeros on each
    /// side (the CIFAR recipe: padding 4 and the image's own size).
    Random { padding: u32 },
}

/// A field of the reference's spatial group: its H and W are `scale` times the reference's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spatial {
    pub scale: u32,
    pub resample: Resample,
}

/// One pipeline of a dataset: how every served sample is cut from the stored one.
#[derive(Debug, Clone, PartialEq)]
pub struct Pipeline {
    pub crop: Crop,
    /// Mirror left to right with probability 1/2.
    pub flip: bool,
    /// The output's (H, W) at the reference's scale; None: the stored size (fixed).
    pub size: Option<(u32, u32)>,
    /// Per stored field: its place in the reference's group (the reference has scale 1), or
    /// None for a field served as stored (a label, say).
    pub spatial: Vec<Option<Spatial>>,
    /// The stored field whose pixels the box is drawn in.
    pub reference: usize,
}

/// Where one sample is cut: the box in the reference's pixels, the output's (W, H) and the flip.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cut {
    pub bx: BoxI,
    pub out: (u32, u32),
    pub flip: bool,
}

impl Pipeline {
    /// Whether the pipeline draws random numbers (the train one).
    pub fn is_random(&self) -> bool {
        self.flip || !matches!(self.crop, Crop::Center)
    }

    /// The fields a stream of this pipeline serves, given the stored ones: each field of the
    /// group gets the output's H and W at its scale (so a batch is one fixed-shape tensor).
    pub fn served(&self, stored: &Schema) -> Result<Schema> {
        let reference = &stored.fields[self.reference];
        let (h, w) = match self.size {
            Some(s) => s,
            None => match spatial_dims(reference) {
                (Some(h), Some(w)) => (h, w),
                _ => bail!(
                    "field {:?} varies in size by sample: set `crop` for the dataset so batches have one size",
                    reference.name
                ),
            },
        };
        if let Crop::Random { padding } = self.crop {
            if let (Some(sh), Some(sw)) = spatial_dims(reference) {
                ensure!(
                    sh + 2 * padding >= h && sw + 2 * padding >= w,
                    "a random {w}x{h} crop does not fit in {:?}'s {sw}x{sh} padded by {padding}",
                    reference.name
                );
            }
        }
        let mut fields = stored.fields.clone();
        for (f, s) in fields.iter_mut().zip(&self.spatial) {
            let Some(s) = s else { continue };
            ensure!(
                f.shape.len() >= 2,
                "field {:?} has {} dims; a spatial one needs at least 2 (..., H, W)",
                f.name,
                f.shape.len()
            );
            ensure!(
                f.dtype.size() == 1 || !self.resamples(),
                "field {:?} is {}: random-resized crops resample, which needs uint8 (use crop = \"random\")",
                f.name,
                f.dtype.name()
            );
            let n = f.shape.len();
            f.shape[n - 2] = Some(h * s.scale);
            f.shape[n - 1] = Some(w * s.scale);
            ensure!(
                f.shape[..n - 2].iter().all(Option::is_some),
                "field {:?}: only its last two dims (H, W) may vary by sample",
                f.name
            );
        }
        Schema::new(fields)
    }

    /// Whether boxes may differ in size from the output (and so are resampled).
    fn resamples(&self) -> bool {
        matches!(self.crop, Crop::RandomResized { .. })
    }

    /// Sample `id`'s cut in epoch `epoch` of a stream seeded `seed`, for a reference of (H, W).
    pub fn cut(&self, seed: u64, epoch: u64, id: u64, (h, w): (u32, u32)) -> Cut {
        let (oh, ow) = self.size.unwrap_or((h, w));
        let mut rng = Rng::new(seed, epoch, id);
        let bx = match self.crop {
            Crop::Center => BoxI {
                x: center(w, ow),
                y: center(h, oh),
                w: ow,
                h: oh,
            },
            Crop::Random { padding } => {
                let p = padding as i64;
                BoxI {
                    x: rng.below((w as i64 + 2 * p - ow as i64).max(0) as u64 + 1) as i64 - p,
                    y: rng.below((h as i64 + 2 * p - oh as i64).max(0) as u64 + 1) as i64 - p,
                    w: ow,
                    h: oh,
                }
            }
            Crop::RandomResized { scale, ratio } => random_resized(&mut rng, (h, w), scale, ratio),
        };
        Cut {
            bx,
            out: (ow, oh),
            flip: self.flip && rng.uniform() < 0.5,
        }
    }

    /// Writes stored field `f` of a sample (all its dims, and its bytes) through `cut` into
    /// `dst`, the field's place in the batch.
    pub fn apply(
        &self,
        f: usize,
        spec: &FieldSpec,
        dims: &[u32],
        data: &[u8],
        cut: &Cut,
        dst: &mut [u8],
    ) -> Result<()> {
        let Some(s) = self.spatial[f] else {
            dst.copy_from_slice(data);
            return Ok(());
        };
        let n = dims.len();
        let (h, w) = (dims[n - 2], dims[n - 1]);
        let k = s.scale;
        let bx = BoxI {
            x: cut.bx.x * k as i64,
            y: cut.bx.y * k as i64,
            w: cut.bx.w * k,
            h: cut.bx.h * k,
        };
        planes::cut(
            data,
            (w, h),
            spec.dtype.size(),
            bx,
            (cut.out.0 * k, cut.out.1 * k),
            cut.flip,
            s.resample,
            dst,
        )
    }
}

/// The (H, W) of a spatial field, each None when it varies by sample.
fn spatial_dims(f: &FieldSpec) -> (Option<u32>, Option<u32>) {
    let n = f.shape.len();
    if n < 2 {
        return (None, None);
    }
    (f.shape[n - 2], f.shape[n - 1])
}

/// The offset of a centered `out` in `size`: torchvision's `CenterCrop` (rounding half to
/// even; negative, so zeros around it, when the image is smaller).
pub(crate) fn center(size: u32, out: u32) -> i64 {
    if size < out {
        return -(((out - size) / 2) as i64);
    }
    let d = size - out;
    let half = d / 2;
    // round(d / 2) with ties to even, as Python's round.
    (if d % 2 == 1 && half % 2 == 1 {
        half + 1
    } else {
        half
    }) as i64
}

/// torchvision's `RandomResizedCrop.get_params`: ten tries at a box of a random area and aspect
/// ratio that fits, else the whole image cut to the nearest allowed ratio, centered.
fn random_resized(rng: &mut Rng, (h, w): (u32, u32), scale: (f64, f64), ratio: (f64, f64)) -> BoxI {
    let area = h as f64 * w as f64;
    let (lo, hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target = area * (scale.0 + (scale.1 - scale.0) * rng.uniform());
        let aspect = (lo + (hi - lo) * rng.uniform()).exp();
        let bw = (target * aspect).sqrt().round() as i64;
        let bh = (target / aspect).sqrt().round() as i64;
        if 0 < bw && bw <= w as i64 && 0 < bh && bh <= h as i64 {
            let y = rng.below((h as i64 - bh) as u64 + 1) as i64;
            let x = rng.below((w as i64 - bw) as u64 + 1) as i64;
            return BoxI {
                x,
                y,
                w: bw as u32,
                h: bh as u32,
            };
        }
    }
    let in_ratio = w as f64 / h as f64;
    let (bw, bh) = if in_ratio < ratio.0 {
        (w, ((w as f64 / ratio.0).round() as u32).clamp(1, h))
    } else if in_ratio > ratio.1 {
        (((h as f64 * ratio.1).round() as u32).clamp(1, w), h)
    } else {
        (w, h)
    };
    BoxI {
        x: ((w - bw) / 2) as i64,
        y: ((h - bh) / 2) as i64,
        w: bw,
        h: bh,
    }
}

/// SplitMix64: a stream of random numbers that is a pure function of (seed, epoch, sample id).
struct Rng(u64);

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    fn new(seed: u64, epoch: u64, id: u64) -> Rng {
        Rng(mix(mix(mix(seed ^ 0x6c61_7264_6572) ^ epoch) ^ id))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in 0..n (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fields::DType;

    fn rrc() -> Pipeline {
        Pipeline {
            crop: Crop::RandomResized {
                scale: (0.08, 1.0),
                ratio: (3.0 / 4.0, 4.0 / 3.0),
            },
            flip: true,
            size: Some((224, 224)),
            spatial: vec![
                Some(Spatial {
                    scale: 1,
                    resample: Resample::Linear,
                }),
                None,
            ],
            reference: 0,
        }
    }

    #[test]
    fn random_resized_boxes_keep_to_their_ranges_and_flip_half_the_time() {
        let p = rrc();
        // Photo sizes after resizing the shorter side to 256.
        for (h, w) in [(256u32, 341u32), (384, 256), (256, 256), (256, 1024)] {
            let mut flips = 0;
            for id in 0..2000 {
                let c = p.cut(7, 3, id, (h, w));
                assert!(c.bx.x >= 0 && c.bx.y >= 0, "{c:?}");
                assert!(
                    c.bx.x as u32 + c.bx.w <= w && c.bx.y as u32 + c.bx.h <= h,
                    "{c:?}"
                );
                let area = (c.bx.w * c.bx.h) as f64 / (w * h) as f64;
                let ratio = c.bx.w as f64 / c.bx.h as f64;
                // Rounding to whole pixels moves the area and ratio a little; the fallback
                // (whole image at the nearest allowed ratio) can exceed neither.
                assert!((0.075..=1.0).contains(&area), "area {area} of {c:?}");
                assert!((0.74..=1.35).contains(&ratio), "ratio {ratio} of {c:?}");
                assert_eq!(c.out, (224, 224));
                flips += c.flip as u32;
            }
            assert!((900..1100).contains(&flips), "{flips} flips of 2000");
        }
    }

    #[test]
    fn cuts_are_a_function_of_seed_epoch_and_sample() {
        let p = rrc();
        let a = p.cut(1, 0, 5, (256, 300));
        assert_eq!(a, p.cut(1, 0, 5, (256, 300)));
        assert_ne!(a, p.cut(1, 1, 5, (256, 300)), "next epoch");
        assert_ne!(a, p.cut(2, 0, 5, (256, 300)), "another seed");
        assert_ne!(a, p.cut(1, 0, 6, (256, 300)), "another sample");
    }

    #[test]
    fn center_crops_match_torchvision() {
        assert_eq!(center(256, 224), 16);
        assert_eq!(center(341, 224), 58); // round(58.5) = 58
        assert_eq!(center(343, 224), 60); // round(59.5) = 60
        assert_eq!(center(200, 224), -12);
        let p = Pipeline {
            crop: Crop::Center,
            flip: false,
            ..rrc()
        };
        assert!(!p.is_random());
        let c = p.cut(1, 2, 3, (256, 341));
        assert_eq!(
            c.bx,
            BoxI {
                x: 58,
                y: 16,
                w: 224,
                h: 224
            }
        );
        assert_eq!(c, p.cut(9, 9, 9, (256, 341)), "no randomness");
    }

    #[test]
    fn padded_random_crops_stay_within_the_padding() {
        let p = Pipeline {
            crop: Crop::Random { padding: 4 },
            flip: true,
            size: None,
            spatial: vec![Some(Spatial {
                scale: 1,
                resample: Resample::Nearest,
            })],
            reference: 0,
        };
        let mut seen = std::collections::BTreeSet::new();
        for id in 0..3000 {
            let c = p.cut(0, 0, id, (32, 32));
            assert!(
                (-4..=4).contains(&c.bx.x) && (-4..=4).contains(&c.bx.y),
                "{c:?}"
            );
            assert_eq!((c.bx.w, c.bx.h, c.out), (32, 32, (32, 32)));
            seen.insert((c.bx.x, c.bx.y));
        }
        assert_eq!(seen.len(), 81, "every offset of -4..=4 in both directions");
        let stored = Schema::new(vec![FieldSpec::fixed("x", DType::Uint8, &[3, 32, 32])]).unwrap();
        assert_eq!(p.served(&stored).unwrap(), stored);
        let variable = Schema::new(vec![FieldSpec::new(
            "x",
            DType::Uint8,
            vec![Some(3), None, None],
        )])
        .unwrap();
        assert!(format!("{:#}", p.served(&variable).unwrap_err()).contains("set `crop`"));
    }

    #[test]
    fn paired_fields_are_cut_at_their_scale() {
        // lr 2x4 and hr 4x8 of one channel each; the box of the right half, flipped.
        let p = Pipeline {
            crop: Crop::Center,
            flip: false,
            size: Some((2, 2)),
            spatial: vec![
                Some(Spatial {
                    scale: 1,
                    resample: Resample::Linear,
                }),
                Some(Spatial {
                    scale: 2,
                    resample: Resample::Nearest,
                }),
            ],
            reference: 0,
        };
        let cut = Cut {
            bx: BoxI {
                x: 2,
                y: 0,
                w: 2,
                h: 2,
            },
            out: (2, 2),
            flip: true,
        };
        let lr: Vec<u8> = (0..8).collect();
        let hr: Vec<u8> = (0..32).collect();
        let spec = FieldSpec::new("x", DType::Uint8, vec![None, None]);
        let mut out = vec![0; 4];
        p.apply(0, &spec, &[2, 4], &lr, &cut, &mut out).unwrap();
        assert_eq!(out, [3, 2, 7, 6]);
        let mut out = vec![0; 16];
        p.apply(1, &spec, &[4, 8], &hr, &cut, &mut out).unwrap();
        assert_eq!(&out[..4], &[7, 6, 5, 4]);
    }
}
