//! One stream of batches: which fields it serves and how, batch assembly (per field one
//! contiguous buffer), and the metered, shutdown-aware forwarding to the client.

use super::buffers::MessageBuffers;
use super::layout::{slot_offsets, FieldLayout};
use super::shm::{Ring, Slot};
use super::shutdown::{shutting_down, Shutdown};
use crate::access::{Caller, PROOF_TTL};
use crate::catalog::Dataset;
use crate::error::{quote, Error, Kind};
use crate::fields::{FieldSpec, FieldView, Schema};
use crate::input_bound::TierMix;
use crate::metrics::Metrics;
use crate::open_streams::StreamHandle;
use crate::pipeline::{Cut, Pipeline};
use crate::proto::{Batch, FieldBatch, VariableLayout};
use crate::sampler::Plan;
use crate::store::Store;
use anyhow::{ensure, Context, Result};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Instant;
use tokio::sync::mpsc;
use tonic::Status;

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

/// A stream's producer: assembles its batches up to `prefetch` ahead of the client, in order,
/// and forwards them until the epoch's end, the client's going away, an error, or the daemon's
/// shutdown.
pub struct Producer {
    pub store: Arc<Store>,
    pub ds: Arc<Dataset>,
    pub plan: Arc<Plan>,
    pub sel: Arc<Selection>,
    /// The stream's shared-memory ring, if it has one, and the slots its client still holds.
    pub ring: Option<Arc<Ring>>,
    pub held_slots: Vec<u32>,
    pub buffers: Arc<MessageBuffers>,
    pub prefetch: usize,
    pub shutdown: Shutdown,
    /// Who asked: their access is checked again whenever the last check is older than
    /// `access::PROOF_TTL`, against the dataset's grants as the catalog has them now (a reload
    /// may have taken one away), and a stream whose caller lost it ends with PERMISSION_DENIED.
    pub who: Caller,
    /// When the check the stream opened on was made (perhaps by an earlier stream).
    pub checked: Instant,
    pub catalog: Arc<crate::catalog::Catalog>,
    /// Tells the memory tier's policy which batch the stream reads.
    pub cursor: crate::open_streams::Cursor,
    /// What the stream takes of the daemon's memory (its plan and order), charged to who
    /// opened it until it ends.
    pub _costs: super::planning::Costs,
}

impl Producer {
    pub async fn run(self, tx: mpsc::Sender<Result<Batch, Status>>) {
        let Producer {
            store,
            ds,
            plan,
            sel,
            ring,
            held_slots,
            buffers,
            prefetch,
            mut shutdown,
            who,
            mut checked,
            catalog,
            cursor,
            _costs,
        } = self;
        // The ring is this stream's until it ends (a previous stream on it must stop first).
        let _lease = match &ring {
            Some(r) => Some(r.begin_stream(&held_slots, plan.start_batch).await),
            None => None,
        };
        let started = Instant::now();
        // The batch the client gets next. In messages it is assembled whatever the message
        // path holds; the batches after it (read ahead) wait while the path holds its share of
        // the memory budget, so the path stays within it but for one batch per stream.
        let next = Arc::new(AtomicU64::new(plan.start_batch));
        let mut batches = futures::stream::iter(plan.start_batch..plan.num_batches)
            .map(|b| {
                let (store, ds, plan, sel) = (store.clone(), ds.clone(), plan.clone(), sel.clone());
                let (ring, buffers, cursor) = (ring.clone(), buffers.clone(), cursor.clone());
                let next = next.clone();
                async move {
                    if ring.is_none() {
                        buffers
                            .wait_to_read_ahead(|| b <= next.load(Ordering::Acquire))
                            .await;
                    }
                    cursor.reading(&plan, b);
                    let (batch, slot, mix) =
                        assemble(&store, &ds, &plan, &sel, b, ring.as_ref(), &buffers).await?;
                    cursor.fetched(mix);
                    Ok((batch, slot))
                }
            })
            .buffered(prefetch);
        loop {
            let result = tokio::select! {
                next = batches.next() => match next {
                    Some(result) => result,
                    None => break,
                },
                _ = shutdown.stopped() => {
                    let _ = tx.send(Err(shutting_down())).await;
                    return;
                }
                // The client went away while a batch waited (for a slot, say).
                _ = tx.closed() => {
                    tracing::info!(dataset = %ds.name, "client went away; stream closed");
                    return;
                }
            };
            if checked.elapsed() >= PROOF_TTL {
                // A dataset taken out of the config finishes its open streams as it was.
                let now = catalog.get(&ds.name).unwrap_or_else(|| ds.clone());
                if let Err(denied) = super::admission::admit(&now, &who).await {
                    let _ = tx.send(Err(denied)).await;
                    return;
                }
                checked = Instant::now();
            }
            let (item, slot) = match result {
                Ok((batch, slot)) => (Ok(batch), slot),
                Err(e) => {
                    tracing::error!(dataset = %ds.name, "stream failed: {e:#}");
                    (Err(crate::error::status(&e)), None)
                }
            };
            let failed = item.is_err();
            if tx.send(item).await.is_err() {
                tracing::info!(dataset = %ds.name, "client went away; stream closed");
                return; // the slot, never delivered, is free again
            }
            next.fetch_add(1, Ordering::Release);
            if let Some(slot) = slot {
                slot.hand_over();
            }
            if failed {
                return;
            }
        }
        tracing::info!(dataset = %ds.name, seconds = started.elapsed().as_secs_f64(), "stream finished");
    }
}

/// Reads the samples of batch `b` through the store (leaving out samples skipped as bad), and
/// packs each selected field into one contiguous buffer, each sample cut by the stream's
/// pipeline: into a slot of the stream's shared-memory ring when it has a free one the batch
/// fits in, else into the message (a buffer from `buffers`). Returns the batch and the slot it
/// went into, and where its samples came from (memory, scratch, raw).
pub async fn assemble(
    store: &Arc<Store>,
    ds: &Arc<Dataset>,
    plan: &Plan,
    sel: &Arc<Selection>,
    b: u64,
    ring: Option<&Arc<Ring>>,
    buffers: &Arc<MessageBuffers>,
) -> Result<(Batch, Option<Slot>, TierMix)> {
    let planned = plan.batch(b);
    let fetched = store.get_many(ds, &planned);
    let mut mix = TierMix::default();
    let fetched: Vec<Option<Bytes>> = fetched
        .await?
        .into_iter()
        .map(|s| {
            s.map(|(data, tier)| {
                mix[tier as usize] += 1;
                data
            })
        })
        .collect();
    // The padding at the batch's end, less its samples skipped as bad.
    let real = planned.len() - plan.padding(b) as usize;
    let padding = fetched[real..].iter().filter(|s| s.is_some()).count() as u32;
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
        step: plan.step(b),
        resume_sample: plan.resume_sample(b),
        padding,
        order_version: plan.order_form.version(),
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
    Ok((batch, slot, mix))
}

/// Where every field lies in a record of fixed fields (the same in every record), and each
/// field's dims.
type Fixed<'a> = (&'a [Range<usize>], Vec<Vec<u32>>);

/// A batch's stored samples, seen field by field.
struct Records<'a> {
    ds: &'a Dataset,
    ids: &'a [u64],
    samples: &'a [Bytes],
    /// Every field fixed: each lies at the same byte range in every record.
    fixed: Option<Fixed<'a>>,
    /// Else each sample's fields, decoded.
    decoded: Vec<Vec<FieldView<'a>>>,
}

impl<'a> Records<'a> {
    fn new(ds: &'a Dataset, ids: &'a [u64], samples: &'a [Bytes]) -> Result<Records<'a>> {
        let mut records = Records {
            ds,
            ids,
            samples,
            fixed: None,
            decoded: vec![],
        };
        if let Some(ranges) = ds.schema.fixed_ranges() {
            let size = ds.schema.fixed_record_bytes().unwrap_or(0) as usize;
            for (s, &i) in samples.iter().zip(ids) {
                ensure!(
                    s.len() == size,
                    "sample {i} of {:?} has {} bytes, its fields take {size}",
                    ds.name,
                    s.len()
                );
            }
            let dims = ds.schema.fields.iter();
            let dims = dims.map(|f| f.shape.iter().map(|d| d.unwrap_or(0)).collect());
            records.fixed = Some((ranges, dims.collect()));
        } else {
            records.decoded = samples
                .iter()
                .zip(ids)
                .map(|(s, &i)| {
                    let what = || format!("sample {i} of {:?} does not fit its fields", ds.name);
                    ds.schema.decode(s).with_context(what)
                })
                .collect::<Result<Vec<_>>>()?;
        }
        Ok(records)
    }

    /// Stored field f's value of every sample, as (variable dims, bytes).
    fn values(&self, f: usize) -> Vec<(&[u32], &[u8])> {
        match &self.fixed {
            Some((ranges, _)) => self
                .samples
                .iter()
                .map(|s| (&[][..], &s[ranges[f].clone()]))
                .collect(),
            None => self
                .decoded
                .iter()
                .map(|r| (&r[f].dims[..], r[f].data))
                .collect(),
        }
    }

    /// All dims of stored field f of sample k.
    fn dims(&self, f: usize, k: usize) -> &[u32] {
        match &self.fixed {
            Some((_, dims)) => &dims[f],
            None => &self.decoded[k][f].dims,
        }
    }

    /// Each sample's cut by the stream's pipeline, drawn in the reference field's (H, W).
    fn cuts<'s>(&self, sel: &'s Selection) -> Option<(&'s Pipeline, Vec<Cut>)> {
        let p = sel.pipeline.as_ref()?;
        let cuts = self.ids.iter().enumerate().map(|(k, &id)| {
            let d = self.dims(p.reference, k);
            let n = d.len();
            p.cut(sel.seed, sel.epoch, id, (d[n - 2], d[n - 1]))
        });
        Some((p, cuts.collect()))
    }

    /// Writes field f's values `v` into `dst` (`layout.bytes` long): cut by the pipeline, or
    /// as stored.
    fn write(
        &self,
        f: usize,
        v: &[(&[u32], &[u8])],
        layout: &FieldLayout,
        cuts: &Option<(&Pipeline, Vec<Cut>)>,
        dst: &mut [u8],
    ) -> Result<()> {
        let Some((p, cuts)) = cuts.as_ref().filter(|(p, _)| p.spatial[f].is_some()) else {
            layout.write(v, dst);
            return Ok(());
        };
        let per = layout.bytes / v.len().max(1);
        for (k, ((_, data), cut)) in v.iter().zip(cuts).enumerate() {
            let spec = &self.ds.schema.fields[f];
            let out = &mut dst[k * per..(k + 1) * per];
            p.apply(f, spec, self.dims(f, k), data, cut, out)
                .with_context(|| format!("cutting sample {} of {:?}", self.ids[k], self.ds.name))?;
        }
        Ok(())
    }
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
    let records = Records::new(ds, ids, samples)?;
    let cuts = records.cuts(sel);
    let fields: Vec<_> = sel
        .fields
        .iter()
        .map(|&f| {
            let v = records.values(f);
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
    let message_bytes: usize = fields.iter().map(|(_, _, l)| l.bytes).sum();
    let max = ds.limits.max_batch_bytes;
    if slot.is_none() && message_bytes as u64 > max {
        // The client's choice: a batch this large cannot go in one message.
        return Err(Error::new(
            Kind::BadRequest,
            format!(
                "batch {b} of {:?} takes {message_bytes} bytes, over the {max} one message may carry (limits.max_batch_bytes): ask for a smaller batch_size",
                ds.name
            ),
        )
        .into());
    }
    let mut out = Vec::with_capacity(fields.len());
    for ((f, v, layout), &off) in fields.into_iter().zip(&offsets) {
        let mut batch = layout.batch.clone();
        match slot.as_mut() {
            Some(slot) => {
                let dst = &mut slot.bytes_mut()[off..off + layout.bytes];
                records.write(f, &v, &layout, &cuts, dst)?;
                batch.slot_offset = off as u64;
                batch.slot_bytes = layout.bytes as u64;
            }
            None => {
                let mut data = buffers.take(layout.bytes);
                match &cuts {
                    Some((p, _)) if p.spatial[f].is_some() => {
                        data.resize(layout.bytes, 0);
                        records.write(f, &v, &layout, &cuts, &mut data)?;
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
        let plan = &handle.spec().plan;
        let (next_batch, num_batches) = (plan.start_batch, plan.num_batches);
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
            Poll::Ready(mut item) => {
                let waited = self.waiting_since.take().map(|since| since.elapsed());
                if let Some(d) = waited {
                    self.handle.record_stall(d);
                }
                match &mut item {
                    Some(Ok(b)) => {
                        self.handle.record_batch_wait(waited.unwrap_or_default());
                        b.stream_id = self.handle.id();
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
        let streams = crate::open_streams::Streams::new(
            Arc::new(crate::tiers::memory::MemoryTier::new(1 << 20)),
            Arc::new(Metrics::default()),
        );
        let handle = streams.open(crate::open_streams::StreamSpec {
            peer: None,
            dataset: "test".into(),
            dataset_id: 0,
            plan: Arc::new(Plan::sequential(end, 1, start)),
            batch_size: 1,
            seed: 0,
            epoch: 0,
            shuffle: false,
            rank: 0,
            world_size: 1,
            shm: false,
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
