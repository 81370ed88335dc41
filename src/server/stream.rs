//! One stream of batches: which fields it serves and how, batch assembly (per field one
//! contiguous buffer), and the metered, shutdown-aware forwarding to the client.

use super::buffers::MessageBuffers;
use super::shm::{Ring, Slot};
use crate::catalog::Dataset;
use crate::error::{quote, Error, Kind};
use crate::fields::{FieldSpec, Schema};
use crate::metrics::Metrics;
use crate::pipeline::{Cut, Pipeline};
use crate::proto::{Batch, FieldBatch, VariableLayout};
use crate::sampler::Plan;
use crate::streams::StreamHandle;
use crate::tiers::store::Store;
use anyhow::{ensure, Context, Result};
use bytes::Bytes;
use futures::Stream;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Instant;
use tokio::sync::mpsc;
use tonic::Status;

/// Largest batch, in bytes, one message may carry.
pub const MAX_BATCH_BYTES: u64 = 256 << 20;

/// What a stream serves of each sample.
#[derive(Debug, Clone)]
pub struct Selection {
    /// The fields served, by index in the schema, in the order asked for.
    pub fields: Vec<usize>,
    pub layout: VariableLayout,
    /// Layout version 0: the first field as Batch.data and a "label" field as Batch.labels.
    pub legacy: Option<Legacy>,
    /// How samples are cut from the stored ones (None: served as stored), and the stream's
    /// seed and epoch, which draw the cuts of the train pipeline.
    pub pipeline: Option<Pipeline>,
    pub seed: u64,
    pub epoch: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct Legacy {
    pub label: Option<usize>,
}

impl Selection {
    /// The fields named (all when none), in that order; errors say what the dataset has.
    pub fn new(
        schema: &Schema,
        names: &[String],
        layout: VariableLayout,
        layout_version: u32,
    ) -> Result<Selection, String> {
        let fields: Vec<usize> = if names.is_empty() {
            (0..schema.fields.len()).collect()
        } else {
            let mut picked = vec![];
            for n in names {
                let (i, _) = schema.field(n).ok_or_else(|| {
                    format!(
                        "no field {}; the dataset's fields are: {}",
                        quote(n),
                        schema.names().join(", ")
                    )
                })?;
                if picked.contains(&i) {
                    return Err(format!("field {} is asked for twice", quote(n)));
                }
                picked.push(i);
            }
            picked
        };
        let legacy = match layout_version {
            1 => None,
            0 => {
                let first = &schema.fields[fields[0]];
                let label = fields[1..]
                    .iter()
                    .copied()
                    .find(|&i| schema.fields[i].name == "label");
                let label_ok = label.is_none_or(|i| {
                    let f = &schema.fields[i];
                    f.shape.is_empty() && f.dtype == crate::fields::DType::Int64
                });
                if !(first.is_fixed()
                    && first.dtype == crate::fields::DType::Uint8
                    && label_ok
                    && fields.len() == 1 + label.is_some() as usize)
                {
                    return Err(format!(
                        "this dataset's samples are {}; this client predates typed fields (it reads one \
                         fixed uint8 array and a label): upgrade it",
                        schema.fields.iter().map(FieldSpec::describe).collect::<Vec<_>>().join(", ")
                    ));
                }
                Some(Legacy { label })
            }
            v => {
                return Err(format!(
                    "layout_version {v} is unknown to this daemon (it knows 0 and 1)"
                ))
            }
        };
        Ok(Selection {
            fields,
            layout,
            legacy,
            pipeline: None,
            seed: 0,
            epoch: 0,
        })
    }
}

/// Reads the samples of batch `b` through the store (leaving out samples skipped as bad), and
/// packs each selected field into one contiguous buffer, each sample cut by the stream's
/// pipeline: into a slot of the stream's shared-memory ring when it has a free one the batch
/// fits in, else into the message (a buffer from `buffers`). Returns the batch and the slot it
/// went into.
pub async fn assemble(
    store: &Arc<Store>,
    ds: &Arc<Dataset>,
    plan: &Plan,
    sel: &Arc<Selection>,
    b: u64,
    ring: Option<&Arc<Ring>>,
    buffers: &Arc<MessageBuffers>,
) -> Result<(Batch, Option<Slot>)> {
    let planned = plan.batch(b);
    let fetched = futures::future::try_join_all(planned.iter().map(|&i| store.get(ds, i))).await?;
    let (ids, samples): (Vec<u64>, Vec<Bytes>) = planned
        .iter()
        .zip(fetched)
        .filter_map(|(&i, s)| s.map(|s| (i, s)))
        .unzip();
    let _held = buffers.hold_samples(samples.iter().map(|s| s.len() as u64).sum());
    let slot = match ring {
        Some(r) => r.claim_for(b).await,
        None => None,
    };
    let shm = ring.is_some();
    let (fields, slot, ids) = if sel.pipeline.is_some() {
        // Cutting (and resampling) is CPU work: off the async threads, batches in parallel.
        let (ds, sel, metrics) = (ds.clone(), sel.clone(), store.metrics.clone());
        let buffers = buffers.clone();
        tokio::task::spawn_blocking(move || {
            let metrics = shm.then_some(&*metrics);
            let (fields, slot) = pack_batch(&ds, &sel, &ids, &samples, slot, &buffers, metrics, b)?;
            Ok::<_, anyhow::Error>((fields, slot, ids))
        })
        .await
        .context("batch assembly failed")??
    } else {
        let metrics = shm.then_some(&*store.metrics);
        let (fields, slot) = pack_batch(ds, sel, &ids, &samples, slot, buffers, metrics, b)?;
        (fields, slot, ids)
    };
    let mut batch = Batch {
        batch_index: b,
        num_batches: plan.num_batches,
        sample_ids: ids,
        slot: slot.as_ref().map_or(0, |s| s.index() + 1),
        step: plan.steps[b as usize],
        resume_sample: plan.resume_sample(b),
        ..Default::default()
    };
    match sel.legacy {
        None => batch.fields = fields,
        Some(legacy) => {
            let mut fields = fields.into_iter();
            let first = fields.next().context("no field")?;
            batch.shape = first.shape.iter().map(|&d| d as u32).collect();
            batch.data = first.data;
            if let (Some(label), Some(_)) = (fields.next(), legacy.label) {
                batch.labels = label
                    .data
                    .chunks_exact(8)
                    .map(|c| i64::from_ne_bytes(c.try_into().unwrap()))
                    .collect();
            }
        }
    }
    Ok((batch, slot))
}

/// The selected fields of samples `ids` (their records `samples`), each as one contiguous
/// buffer: in `slot` if it is large enough (else the slot is let go and the bytes go in the
/// messages, in buffers from `buffers`). `metrics`, for streams with a ring: counts where the
/// batch went.
#[allow(clippy::too_many_arguments)]
fn pack_batch(
    ds: &Dataset,
    sel: &Selection,
    ids: &[u64],
    samples: &[Bytes],
    mut slot: Option<Slot>,
    buffers: &MessageBuffers,
    metrics: Option<&Metrics>,
    b: u64,
) -> Result<(Vec<FieldBatch>, Option<Slot>)> {
    let fixed = ds.schema.fixed_ranges();
    let records = match &fixed {
        Some(_) => {
            // Every field fixed: each lies at the same place in every record.
            let size = ds.schema.fixed_record_bytes().unwrap_or(0) as usize;
            for (s, &i) in samples.iter().zip(ids) {
                ensure!(
                    s.len() == size,
                    "sample {i} of {:?} has {} bytes, its fields take {size}",
                    ds.name,
                    s.len()
                );
            }
            vec![]
        }
        None => samples
            .iter()
            .zip(ids)
            .map(|(s, &i)| {
                ds.schema
                    .decode(s)
                    .with_context(|| format!("sample {i} of {:?} does not fit its fields", ds.name))
            })
            .collect::<Result<Vec<_>>>()?,
    };
    // Stored field f's value of every sample, as (variable dims, bytes).
    let values = |f: usize| -> Vec<(&[u32], &[u8])> {
        match &fixed {
            Some(ranges) => samples
                .iter()
                .map(|s| (&[][..], &s[ranges[f].clone()]))
                .collect(),
            None => records
                .iter()
                .map(|r| (&r[f].dims[..], r[f].data))
                .collect(),
        }
    };
    // All dims of stored field f of sample k (of every sample, when fixed).
    let fixed_dims: Vec<Vec<u32>> = match &fixed {
        Some(_) => ds
            .schema
            .fields
            .iter()
            .map(|f| f.shape.iter().map(|d| d.unwrap_or(0)).collect())
            .collect(),
        None => vec![],
    };
    let dims = |f: usize, k: usize| -> &[u32] {
        match &fixed {
            Some(_) => &fixed_dims[f],
            None => &records[k][f].dims,
        }
    };
    // Each sample's cut, drawn in the reference field's (H, W).
    let cuts: Option<(&Pipeline, Vec<Cut>)> = sel.pipeline.as_ref().map(|p| {
        let cuts = ids
            .iter()
            .enumerate()
            .map(|(k, &id)| {
                let d = dims(p.reference, k);
                let n = d.len();
                p.cut(sel.seed, sel.epoch, id, (d[n - 2], d[n - 1]))
            })
            .collect();
        (p, cuts)
    });
    let fields: Vec<_> = sel
        .fields
        .iter()
        .map(|&f| {
            let v = values(f);
            let layout = FieldLayout::new(&ds.served.fields[f], &v, sel.layout);
            (f, v, layout)
        })
        .collect();
    let (offsets, at) = slot_offsets(fields.iter().map(|(_, _, l)| l.bytes));
    if slot.as_ref().is_some_and(|s| s.capacity() < at) {
        slot = None; // a variable batch larger than the slots: this one goes in the message
    }
    if let Some(m) = metrics {
        m.record_shm(slot.is_some());
    }
    // Writes field f's values into dst: cut by the pipeline, or as stored.
    let write =
        |f: usize, v: &[(&[u32], &[u8])], layout: &FieldLayout, dst: &mut [u8]| -> Result<()> {
            match &cuts {
                Some((p, cuts)) if p.spatial[f].is_some() => {
                    let per = layout.bytes / v.len().max(1);
                    for (k, ((_, data), cut)) in v.iter().zip(cuts).enumerate() {
                        p.apply(
                            f,
                            &ds.schema.fields[f],
                            dims(f, k),
                            data,
                            cut,
                            &mut dst[k * per..(k + 1) * per],
                        )
                        .with_context(|| format!("cutting sample {} of {:?}", ids[k], ds.name))?;
                    }
                    Ok(())
                }
                _ => {
                    layout.write(v, dst);
                    Ok(())
                }
            }
        };
    let mut out = Vec::with_capacity(fields.len());
    let mut bytes = 0u64;
    for ((f, v, layout), &off) in fields.into_iter().zip(&offsets) {
        let mut batch = layout.batch.clone();
        match slot.as_mut() {
            Some(slot) => {
                write(
                    f,
                    &v,
                    &layout,
                    &mut slot.bytes_mut()[off..off + layout.bytes],
                )?;
                batch.slot_offset = off as u64;
                batch.slot_bytes = layout.bytes as u64;
            }
            None => {
                bytes += layout.bytes as u64;
                ensure!(
                    bytes <= MAX_BATCH_BYTES,
                    "batch {b} of {:?} takes over {MAX_BATCH_BYTES} bytes, more than one message may carry: ask for a smaller batch_size",
                    ds.name
                );
                let mut data = buffers.take(layout.bytes);
                match &cuts {
                    Some((p, _)) if p.spatial[f].is_some() => {
                        data.resize(layout.bytes, 0);
                        write(f, &v, &layout, &mut data)?;
                    }
                    _ => layout.append_to(&v, &mut data),
                }
                batch.data = buffers.finish(data);
            }
        }
        out.push(batch);
    }
    Ok((out, slot))
}

/// Where each field of a batch goes in a shared-memory slot, given the fields' sizes: one after
/// the other, each 64-byte aligned. Returns the offsets and the bytes the slot needs.
pub fn slot_offsets(sizes: impl IntoIterator<Item = usize>) -> (Vec<usize>, usize) {
    let mut at = 0usize;
    let offsets = sizes
        .into_iter()
        .map(|bytes| {
            let o = at;
            at = (at + bytes).div_ceil(64) * 64;
            o
        })
        .collect();
    (offsets, at)
}

/// One field of a batch laid out: its message (name, dtype, shapes, lengths, offsets; no
/// bytes yet), how many bytes it takes and, padded, the batch's largest dims.
struct FieldLayout {
    batch: FieldBatch,
    bytes: usize,
    item: usize,
    /// Padded variable fields: the dims every value is padded to.
    padded_to: Option<Vec<u32>>,
}

impl FieldLayout {
    fn new(spec: &FieldSpec, values: &[(&[u32], &[u8])], layout: VariableLayout) -> FieldLayout {
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
            let bytes = n * spec.fixed_bytes().unwrap_or(0) as usize;
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
                bytes: total as usize * item,
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
        let per: usize = max.iter().fold(item, |a, &d| a * d as usize);
        batch.shape = std::iter::once(n as u64)
            .chain(max.iter().map(|&d| d as u64))
            .collect();
        FieldLayout {
            batch,
            bytes: n * per,
            item,
            padded_to: Some(max),
        }
    }

    /// Writes the values into `dst` (exactly `self.bytes` long, any previous content: a slot).
    fn write(&self, values: &[(&[u32], &[u8])], dst: &mut [u8]) {
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
    fn append_to(&self, values: &[(&[u32], &[u8])], dst: &mut Vec<u8>) {
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

/// The outgoing stream: hands the producer's batches on, counting in the stream's registration
/// the time it waits for a batch that is not ready (client stall) and the batches it hands on.
pub struct MeteredStream {
    pub rx: mpsc::Receiver<Result<Batch, Status>>,
    /// The stream's registration: it stays open while this lives.
    pub handle: StreamHandle,
    pub waiting_since: Option<Instant>,
    /// The batch the client gets next, and the end of the epoch: a stream that ends before it
    /// ends with an error, never as if the epoch were complete.
    pub next_batch: u64,
    pub num_batches: u64,
}

impl MeteredStream {
    pub fn new(rx: mpsc::Receiver<Result<Batch, Status>>, handle: StreamHandle) -> MeteredStream {
        let (next_batch, num_batches) = (handle.spec().start_batch, handle.spec().num_batches);
        MeteredStream {
            rx,
            handle,
            waiting_since: None,
            next_batch,
            num_batches,
        }
    }
}

/// Bytes a batch carries.
fn batch_bytes(b: &Batch) -> u64 {
    b.data.len() as u64 + b.fields.iter().map(|f| f.data.len() as u64).sum::<u64>()
}

impl Stream for MeteredStream {
    type Item = Result<Batch, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        match self.rx.poll_recv(cx) {
            Poll::Pending => {
                self.waiting_since.get_or_insert_with(Instant::now);
                Poll::Pending
            }
            Poll::Ready(item) => {
                if let Some(since) = self.waiting_since.take() {
                    self.handle.record_stall(since.elapsed());
                }
                match &item {
                    Some(Ok(b)) => {
                        self.next_batch = b.batch_index + 1;
                        self.handle.record_batch(
                            b.batch_index,
                            b.sample_ids.len() as u64,
                            batch_bytes(b),
                        );
                    }
                    Some(Err(_)) => self.next_batch = self.num_batches, // the error says why
                    None if self.next_batch < self.num_batches => {
                        let missing = self.next_batch;
                        self.next_batch = self.num_batches;
                        tracing::error!(stream = %self.handle.spec().name(), batch = missing, "stream producer stopped early");
                        return Poll::Ready(Some(Err(Error::new(
                            Kind::Internal,
                            format!(
                                "larderd stopped this stream before batch {missing} of {}; resume from it",
                                self.num_batches
                            ),
                        )
                        .into())));
                    }
                    None => {}
                }
                Poll::Ready(item)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fields::DType;
    use futures::StreamExt;

    fn metered(rx: mpsc::Receiver<Result<Batch, Status>>, start: u64, end: u64) -> MeteredStream {
        let streams = crate::streams::Streams::new(
            Arc::new(crate::tiers::memory::MemoryTier::new(1 << 20)),
            Arc::new(Metrics::default()),
        );
        let handle = streams.open(crate::streams::StreamSpec {
            dataset: "test".into(),
            start_batch: start,
            num_batches: end,
            ..Default::default()
        });
        MeteredStream::new(rx, handle)
    }

    fn batch(i: u64) -> Result<Batch, Status> {
        Ok(Batch {
            batch_index: i,
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn a_stream_cut_short_ends_with_an_error_not_as_complete() {
        let (tx, rx) = mpsc::channel(4);
        tx.send(batch(2)).await.unwrap();
        drop(tx); // the producer is gone after batch 2 of 5
        let items: Vec<_> = metered(rx, 2, 5).collect().await;
        assert_eq!(items.len(), 2);
        let err = items[1].as_ref().unwrap_err();
        assert_eq!(err.code(), tonic::Code::Internal);
        assert!(
            err.message().contains("before batch 3 of 5"),
            "{}",
            err.message()
        );

        let (tx, rx) = mpsc::channel(4);
        tx.send(batch(3)).await.unwrap();
        tx.send(batch(4)).await.unwrap();
        drop(tx);
        let items: Vec<_> = metered(rx, 3, 5).collect().await;
        assert!(
            items.iter().all(|i| i.is_ok()),
            "a complete stream ends cleanly"
        );
    }

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

    #[test]
    fn old_clients_get_the_legacy_layout_or_a_clear_refusal() {
        let classic = Schema::new(vec![
            FieldSpec::fixed("image", DType::Uint8, &[3, 2, 2]),
            FieldSpec::fixed("label", DType::Int64, &[]),
        ])
        .unwrap();
        let s = Selection::new(&classic, &[], VariableLayout::Padded, 0).unwrap();
        assert_eq!(s.legacy.unwrap().label, Some(1));
        let flow = Schema::new(vec![FieldSpec::fixed("flow", DType::Float32, &[2, 2, 2])]).unwrap();
        let err = Selection::new(&flow, &[], VariableLayout::Padded, 0).unwrap_err();
        assert!(err.contains("upgrade"), "{err}");
        assert!(Selection::new(&flow, &[], VariableLayout::Padded, 1).is_ok());
        let err =
            Selection::new(&classic, &["nope".into()], VariableLayout::Padded, 1).unwrap_err();
        assert!(err.contains("fields are: image, label"), "{err}");
    }
}
