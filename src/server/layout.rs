//! How a batch's fields are laid out: per field one contiguous buffer of its dtype (fixed
//! shapes as `[B, ...]`; variable ones padded to the batch's largest with lengths, or back to
//! back with offsets), and where each field goes in a shared-memory slot.

use crate::fields::FieldSpec;
use crate::proto::{FieldBatch, VariableLayout};

/// Where each field of a batch goes in a shared-memory slot, given the fields' sizes: one after
/// the other, each 64-byte aligned. Returns the offsets and the bytes the slot needs.
pub fn slot_offsets(sizes: impl IntoIterator<Item = usize>) -> (Vec<usize>, usize) {
    let mut at = 0usize;
    let offsets = sizes
        .into_iter()
        .map(|bytes| {
            let o = at;
            at = at.saturating_add(bytes).div_ceil(64).saturating_mul(64);
            o
        })
        .collect();
    (offsets, at)
}

/// One field of a batch laid out: its message (name, dtype, shapes, lengths, offsets; no
/// bytes yet), how many bytes it takes and, padded, the batch's largest dims.
pub struct FieldLayout {
    pub batch: FieldBatch,
    pub bytes: usize,
    item: usize,
    /// Padded variable fields: the dims every value is padded to.
    padded_to: Option<Vec<u32>>,
}

impl FieldLayout {
    pub fn new(
        spec: &FieldSpec,
        values: &[(&[u32], &[u8])],
        layout: VariableLayout,
    ) -> FieldLayout {
        let n = values.len();
        let mut batch = FieldBatch {
            name: spec.name.clone(),
            dtype: spec.dtype.name().to_string(),
            sample_shape: spec.shape_i64(),
            ..Default::default()
        };
        let item = spec.dtype.size();
        if spec.is_fixed() {
            batch.shape = std::iter::once(n as u64)
                .chain(spec.shape.iter().map(|d| d.unwrap_or(0) as u64))
                .collect();
            let bytes = n.saturating_mul(spec.fixed_bytes().unwrap_or(0) as usize);
            return FieldLayout {
                batch,
                bytes,
                item,
                padded_to: None,
            };
        }
        for (dims, _) in values {
            for (d, s) in dims.iter().zip(&spec.shape) {
                if s.is_none() {
                    batch.lengths.push(*d);
                }
            }
        }
        if layout == VariableLayout::Offsets {
            let mut offsets = Vec::with_capacity(n + 1);
            let mut total = 0u64;
            offsets.push(0);
            for (_, v) in values {
                total += (v.len() / item) as u64;
                offsets.push(total);
            }
            batch.shape = vec![total];
            batch.offsets = offsets;
            return FieldLayout {
                batch,
                bytes: (total as usize).saturating_mul(item),
                item,
                padded_to: None,
            };
        }
        // Padded: every value at the start of the batch maximum along each dim, zeros after.
        let mut max: Vec<u32> = spec.shape.iter().map(|d| d.unwrap_or(0)).collect();
        for (dims, _) in values {
            for (m, d) in max.iter_mut().zip(*dims) {
                *m = (*m).max(*d);
            }
        }
        // Saturating: per-dim maxima of different samples ([1, 10^5] and [10^5, 1]) multiply
        // to more than any sample holds; the batch limit then refuses the batch.
        let per = crate::fields::bytes_of(item, &max);
        batch.shape = std::iter::once(n as u64)
            .chain(max.iter().map(|&d| d as u64))
            .collect();
        FieldLayout {
            batch,
            bytes: n.saturating_mul(per),
            item,
            padded_to: Some(max),
        }
    }

    /// Writes the values into `dst` (exactly `self.bytes` long, any previous content: a slot).
    pub fn write(&self, values: &[(&[u32], &[u8])], dst: &mut [u8]) {
        match &self.padded_to {
            None => {
                let mut at = 0;
                for (_, v) in values {
                    dst[at..at + v.len()].copy_from_slice(v);
                    at += v.len();
                }
            }
            Some(max) => {
                dst.fill(0);
                self.pad_into(values, max, dst);
            }
        }
    }

    /// Appends the values to `dst` (for a message; written once: no zeroing but the
    /// padding's).
    pub fn append_to(&self, values: &[(&[u32], &[u8])], dst: &mut Vec<u8>) {
        match &self.padded_to {
            None => {
                for (_, v) in values {
                    dst.extend_from_slice(v);
                }
            }
            Some(max) => {
                let at = dst.len();
                dst.resize(at + self.bytes, 0);
                self.pad_into(values, max, &mut dst[at..]);
            }
        }
    }

    /// Copies each value to the start of its zeroed `max`-sized place in `dst`.
    fn pad_into(&self, values: &[(&[u32], &[u8])], max: &[u32], dst: &mut [u8]) {
        let per = if values.is_empty() {
            0
        } else {
            self.bytes / values.len()
        };
        for (k, (dims, v)) in values.iter().enumerate() {
            copy_padded(v, dims, &mut dst[k * per..(k + 1) * per], max, self.item);
        }
    }
}

/// One field of `n` samples, each given as (dims, bytes), as a batch with its bytes.
#[cfg(test)]
fn pack<'a>(
    spec: &FieldSpec,
    values: impl Iterator<Item = (&'a [u32], &'a [u8])>,
    layout: VariableLayout,
) -> FieldBatch {
    let values: Vec<_> = values.collect();
    let l = FieldLayout::new(spec, &values, layout);
    let mut data = Vec::new();
    l.append_to(&values, &mut data);
    FieldBatch {
        data: data.into(),
        ..l.batch
    }
}

/// Copies a row-major array of `dims` into the top corner of a zeroed one of `max` dims.
fn copy_padded(src: &[u8], dims: &[u32], dst: &mut [u8], max: &[u32], item: usize) {
    let Some((&last, outer)) = dims.split_last() else {
        dst[..src.len()].copy_from_slice(src);
        return;
    };
    let row = last as usize * item;
    if row == 0 || outer.contains(&0) {
        return;
    }
    // Strides of the destination, in bytes.
    let mut strides = vec![0usize; max.len()];
    let mut s = item;
    for (st, &m) in strides.iter_mut().zip(max).rev() {
        *st = s;
        s *= m as usize;
    }
    let mut at = vec![0u32; outer.len()];
    for chunk in src.chunks_exact(row) {
        let off: usize = at
            .iter()
            .zip(&strides)
            .map(|(&i, &st)| i as usize * st)
            .sum();
        dst[off..off + row].copy_from_slice(chunk);
        // Next index of the outer dims, last fastest.
        for (i, &d) in at.iter_mut().zip(outer).rev() {
            *i += 1;
            if *i < d {
                break;
            }
            *i = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fields::DType;

    #[test]
    fn variable_fields_are_padded_with_lengths_or_come_with_offsets() {
        // Boxes [K, 4] of int16: K = 1, 0, 2.
        let spec = FieldSpec::new("boxes", DType::Int16, vec![None, Some(4)]);
        let vals: Vec<(Vec<u32>, Vec<u8>)> = [1u32, 0, 2]
            .iter()
            .map(|&k| (vec![k, 4], (0..k * 8).map(|b| b as u8 + 1).collect()))
            .collect();
        let it = vals.iter().map(|(d, v)| (&d[..], &v[..]));
        let padded = pack(&spec, it.clone(), VariableLayout::Padded);
        assert_eq!(padded.shape, vec![3, 2, 4]);
        assert_eq!(padded.lengths, vec![1, 0, 2]);
        assert_eq!(padded.data.len(), 3 * 2 * 4 * 2);
        assert_eq!(&padded.data[..8], &vals[0].1[..]);
        assert!(padded.data[8..32].iter().all(|&b| b == 0), "padding");
        assert_eq!(&padded.data[32..], &vals[2].1[..]);
        let offsets = pack(&spec, it, VariableLayout::Offsets);
        assert_eq!(offsets.offsets, vec![0, 4, 4, 12]);
        assert_eq!(offsets.shape, vec![12]);
        assert_eq!(offsets.lengths, vec![1, 0, 2]);
        assert_eq!(offsets.data.len(), 24);
    }

    #[test]
    fn images_of_different_sizes_pad_in_both_dims() {
        let spec = FieldSpec::new("image", DType::Uint8, vec![Some(1), None, None]);
        let a = (vec![1, 2, 3], vec![1, 2, 3, 4, 5, 6]);
        let b = (vec![1, 3, 1], vec![7, 8, 9]);
        let vals = [a, b];
        let p = pack(
            &spec,
            vals.iter().map(|(d, v)| (&d[..], &v[..])),
            VariableLayout::Padded,
        );
        assert_eq!(p.shape, vec![2, 1, 3, 3]);
        assert_eq!(p.lengths, vec![2, 3, 3, 1]);
        assert_eq!(
            &p.data[..],
            &[1, 2, 3, 4, 5, 6, 0, 0, 0, 7, 0, 0, 8, 0, 0, 9, 0, 0]
        );
        // Into a slot that held an earlier batch: the same bytes, padding zeroed.
        let values: Vec<_> = vals.iter().map(|(d, v)| (&d[..], &v[..])).collect();
        let layout = FieldLayout::new(&spec, &values, VariableLayout::Padded);
        let mut slot = vec![0xAA; layout.bytes];
        layout.write(&values, &mut slot);
        assert_eq!(&slot[..], &p.data[..]);
    }
}
