//! Records of one size packed into large slabs, so the memory tier holds about one byte of
//! budget per byte of sample. Each record allocated alone takes the allocator's size class (a
//! 12,296-byte record takes 14,336: 17% more), and each new one faults fresh pages. A slab is
//! one 2 MiB allocation cut into slots of one size (the record's length rounded up to 16
//! bytes); a record copied into a free slot costs its slot, and a slot freed is taken by the
//! next record of that size without a page fault.
//!
//! A size gets slabs when a fixed-shape dataset opens (its records are all one size: `expect`);
//! other sizes (variable-sized images) stay with the allocator, where a slab each would hold
//! mostly empty slots that the budget does not see. A record in a slab is a `Bytes`
//! whose owner gives its slot back when the last clone drops (a stream may still be sending it
//! after the tier let it go). The tier moves records out of its emptiest slab when a size has
//! more than a slab's worth of free slots (`Slabs::compact`), so empty slots stay bounded: at
//! most about one slab per size, beyond what streams still hold.

use super::eviction::Key;
use crate::sync::Locked;
use bytes::Bytes;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Bytes a slab takes: large enough that the allocator maps it page by page (no size class to
/// round up to beyond the page), small enough that a size's partly empty slab is little.
const SLAB_BYTES: usize = 2 << 20;
/// Records of this many bytes or more go to slabs (below, the allocator's classes are close).
const MIN_RECORD: usize = 1024;
/// Records larger than this stay with the allocator (fewer than 4 a slab).
const MAX_RECORD: usize = SLAB_BYTES / 4;

/// The slot a record of `len` bytes takes, if it goes to a slab at all.
fn slot_of(len: usize) -> Option<usize> {
    (MIN_RECORD..=MAX_RECORD)
        .contains(&len)
        .then(|| len.div_ceil(16) * 16)
}

/// One slab: `slots` slots of `slot` bytes in one allocation.
struct Slab {
    base: NonNull<u8>,
    slot: usize,
    slots: usize,
    /// Slots no `Bytes` holds, taken from the end.
    free: Mutex<Vec<u32>>,
}

// SAFETY: the slab's memory is written only through a slot taken from `free` (so by one
// thread, before any `Bytes` of that slot exists) and read only through the `Bytes` of its
// slot; `free` is behind a mutex.
unsafe impl Send for Slab {}
// SAFETY: as for Send above: shared access goes through the slots' `Bytes` and the mutex.
unsafe impl Sync for Slab {}

impl Slab {
    fn new(slot: usize) -> Arc<Slab> {
        let slots = (SLAB_BYTES / slot).max(1);
        let layout = std::alloc::Layout::from_size_align(slot * slots, 64).expect("a valid layout");
        // SAFETY: a non-zero size; the pointer is checked.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let base = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Arc::new(Slab {
            base,
            slot,
            slots,
            free: Mutex::new((0..slots as u32).rev().collect()),
        })
    }

    fn bytes(&self) -> usize {
        self.slot * self.slots
    }

    fn free_slots(&self) -> usize {
        self.free.locked().len()
    }

    /// `data` copied into a free slot, as `Bytes` that give the slot back when the last clone
    /// drops; None when the slab is full.
    fn place(self: &Arc<Slab>, data: &[u8]) -> Option<Bytes> {
        debug_assert!(data.len() <= self.slot);
        let index = self.free.locked().pop()?;
        // SAFETY: the slot was free, so nothing reads or writes it; it lies within the slab.
        unsafe {
            let at = self.base.as_ptr().add(index as usize * self.slot);
            std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len());
        }
        Some(Bytes::from_owner(Held {
            slab: self.clone(),
            index,
            len: data.len(),
        }))
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.bytes(), 64).expect("a valid layout");
        // SAFETY: allocated in `new` with this layout; no slot is held (each holds the Arc).
        unsafe { std::alloc::dealloc(self.base.as_ptr(), layout) };
    }
}

/// A slot holding a record: the owner of the record's `Bytes`.
struct Held {
    slab: Arc<Slab>,
    index: u32,
    len: usize,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the slot is this owner's until it drops, written before it was made.
        unsafe {
            let at = self
                .slab
                .base
                .as_ptr()
                .add(self.index as usize * self.slab.slot);
            std::slice::from_raw_parts(at, self.len)
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut free = self.slab.free.locked();
        free.push(self.index);
    }
}

/// The slabs of one slot size.
struct Class {
    slabs: Vec<Arc<Slab>>,
    /// The slab records went to last: tried first.
    current: usize,
}

/// Every size's slabs (the memory tier's, used under its lock).
#[derive(Default)]
pub struct Slabs {
    classes: HashMap<usize, Class>,
}

/// Where a record the tier keeps lives: in a slab, or allocated alone.
pub struct Placed {
    pub data: Bytes,
    /// The bytes it takes: its slot, or the allocator's size class.
    pub bytes: u64,
}

impl Slabs {
    /// `data` as the tier keeps it: copied into a slot of its size when that size has slabs
    /// (`expect`; a new slab when they are full), else as it came.
    pub fn place(&mut self, data: Bytes) -> Placed {
        let alone = |data: Bytes| Placed {
            bytes: crate::alloc::allocation_size(data.len()) as u64,
            data,
        };
        let Some(slot) = slot_of(data.len()) else {
            return alone(data);
        };
        let Some(class) = self.classes.get_mut(&slot) else {
            return alone(data);
        };
        // The slab used last, else the first with room, else a new one.
        let n = class.slabs.len();
        let placed = (0..n)
            .map(|k| (class.current + k) % n)
            .find_map(|k| class.slabs[k].place(&data).map(|d| (k, d)));
        let data = match placed {
            Some((k, d)) => {
                class.current = k;
                d
            }
            None => {
                let slab = Slab::new(slot);
                let d = slab.place(&data).expect("a new slab has room");
                class.slabs.push(slab);
                class.current = n;
                d
            }
        };
        Placed {
            data,
            bytes: slot as u64,
        }
    }

    /// Records of `len` bytes will come (a fixed-shape dataset's): their size has slabs now.
    pub fn expect(&mut self, len: usize) {
        if let Some(slot) = slot_of(len) {
            self.classes.entry(slot).or_insert(Class {
                slabs: vec![],
                current: 0,
            });
        }
    }

    /// The bytes the tier charges a record of `len` bytes: its slot when its size has slabs,
    /// else the allocator's size class.
    pub fn cost(&self, len: usize) -> u64 {
        match slot_of(len) {
            Some(slot) if self.classes.contains_key(&slot) => slot as u64,
            _ => crate::alloc::allocation_size(len) as u64,
        }
    }

    /// Bytes the slabs take in all, free slots included.
    pub fn bytes(&self) -> u64 {
        self.classes
            .values()
            .flat_map(|c| &c.slabs)
            .map(|s| s.bytes() as u64)
            .sum()
    }

    /// Frees what the tier's letting go of records left empty: slabs with no slot held are
    /// given back; and when a size has more than a slab's worth of free slots, the records
    /// `entries` holds in its emptiest slab move to free slots of the others (`entries`: the
    /// tier's records, by key, whose `Bytes` are replaced), so that slab empties as streams
    /// drop what they hold of it.
    pub fn compact<'a>(&mut self, entries: impl Iterator<Item = (&'a Key, &'a mut Bytes)>) {
        for class in self.classes.values_mut() {
            class
                .slabs
                .retain(|s| Arc::strong_count(s) > 1 || s.free_slots() < s.slots);
            class.current = 0;
        }
        let crowded: Vec<usize> = self
            .classes
            .iter()
            .filter(|(_, c)| {
                let per = c.slabs.first().map_or(usize::MAX, |s| s.slots);
                c.slabs.len() > 1 && c.slabs.iter().map(|s| s.free_slots()).sum::<usize>() > per
            })
            .map(|(&slot, _)| slot)
            .collect();
        if crowded.is_empty() {
            return;
        }
        // The emptiest slab of each crowded size gives up its records.
        let donors: Vec<Arc<Slab>> = crowded
            .iter()
            .filter_map(|slot| {
                let class = self.classes.get_mut(slot)?;
                let k = (0..class.slabs.len()).max_by_key(|&k| class.slabs[k].free_slots())?;
                Some(class.slabs.remove(k))
            })
            .collect();
        for (_, data) in entries {
            let Some(donor) = donors.iter().find(|d| held_by(d, data)) else {
                continue;
            };
            let class = self.classes.get_mut(&donor.slot).expect("a crowded size");
            let moved = class.slabs.iter().find_map(|s| s.place(data));
            if let Some(moved) = moved {
                *data = moved;
            } else {
                // No room elsewhere after all: the donor stays.
                if !class.slabs.iter().any(|s| Arc::ptr_eq(s, donor)) {
                    class.slabs.push(donor.clone());
                }
            }
        }
    }
}

/// Whether `data` lies in `slab`'s memory.
fn held_by(slab: &Slab, data: &Bytes) -> bool {
    let start = slab.base.as_ptr() as usize;
    let p = data.as_ptr() as usize;
    (start..start + slab.bytes()).contains(&p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(len: usize, fill: u8) -> Bytes {
        Bytes::from(vec![fill; len])
    }

    #[test]
    fn a_size_a_dataset_expects_gets_slots_of_its_own_length() {
        let mut slabs = Slabs::default();
        let len = 12_296;
        // Before its size has slabs: the allocator's class (14,336).
        let alone = slabs.place(record(len, 1));
        assert_eq!(alone.bytes, crate::alloc::allocation_size(len) as u64);
        assert!(alone.bytes >= 14_000);
        slabs.expect(len);
        let mut kept = vec![];
        for i in 0..10 {
            let p = slabs.place(record(len, i as u8));
            assert_eq!(&p.data[..], &vec![i as u8; len][..], "the record's bytes");
            kept.push(p);
        }
        let last = kept.last().unwrap();
        assert_eq!(last.bytes, 12_304, "the length rounded up to 16");
        assert_eq!(slabs.cost(len), 12_304);
        assert_eq!(
            slabs.bytes(),
            (SLAB_BYTES / 12_304 * 12_304) as u64,
            "one slab so far"
        );
        // Other sizes, and small or huge ones, stay with the allocator.
        assert_eq!(
            slabs.cost(12_400),
            crate::alloc::allocation_size(12_400) as u64
        );
        assert_eq!(slot_of(100), None);
        assert_eq!(slot_of(MAX_RECORD + 1), None);
    }

    #[test]
    fn slots_come_back_when_the_last_clone_drops_and_empty_slabs_go() {
        let mut slabs = Slabs::default();
        let len = 4000;
        slabs.expect(len);
        let per = SLAB_BYTES / 4000;
        let mut held: Vec<(Key, Bytes)> = (0..2 * per as u64)
            .map(|i| ((0, i), slabs.place(record(len, i as u8)).data))
            .collect();
        assert_eq!(slabs.bytes(), 2 * (per * 4000) as u64);
        // A stream still holds one record the tier lets go: its slot stays taken.
        let streamed = held[0].1.clone();
        held.truncate(per);
        slabs.compact(held.iter_mut().map(|(k, b)| (&*k, b)));
        assert_eq!(
            slabs.bytes(),
            (per * 4000) as u64,
            "the emptied second slab is given back"
        );
        // The tier lets every record go; the slab stays while a stream holds one of them.
        held.clear();
        slabs.compact(std::iter::empty());
        assert_eq!(slabs.bytes(), (per * 4000) as u64, "held by the stream");
        assert_eq!(
            &streamed[..],
            &vec![0u8; len][..],
            "a streamed record is intact"
        );
        drop(streamed);
        slabs.compact(std::iter::empty());
        assert_eq!(slabs.bytes(), 0);
    }

    #[test]
    fn compaction_moves_the_emptiest_slabs_records_and_keeps_their_bytes() {
        let mut slabs = Slabs::default();
        let len = 100_000; // 20 a slab
        slabs.expect(len);
        let mut held: Vec<(Key, Bytes)> = (0..60u64)
            .map(|i| ((0, i), slabs.place(record(len, i as u8)).data))
            .collect();
        assert_eq!(slabs.bytes(), 3 * 20 * 100_000);
        // Keep one in three: 20 records over three slabs, 40 slots free.
        held.retain(|((_, i), _)| i % 3 == 0);
        slabs.compact(held.iter_mut().map(|(k, b)| (&*k, b)));
        slabs.compact(held.iter_mut().map(|(k, b)| (&*k, b)));
        for ((_, i), b) in &held {
            assert_eq!(&b[..], &vec![*i as u8; len][..], "record {i} moved whole");
        }
        assert!(
            slabs.bytes() <= 2 * 20 * 100_000,
            "a slab given back: {}",
            slabs.bytes()
        );
    }

    #[test]
    fn a_tier_holds_about_a_byte_of_budget_per_byte_of_sample() {
        use crate::tiers::memory::{cost_of, MemoryTier, ENTRY_OVERHEAD};
        // A 3x64x64 uint8 record and its int64 label.
        let len = 12_296;
        let budget = 300 * cost_of(len);
        let tier = MemoryTier::stale_lru(budget);
        tier.expect_size(len);
        for i in 0..2000u64 {
            tier.insert((1, i), record(len, i as u8), len as u64);
        }
        let s = tier.snapshot();
        // Every record in a slot: 16% more than the 300 the allocator's classes allow.
        let slotted = budget / (12_304 + ENTRY_OVERHEAD);
        assert_eq!(s.entries, slotted);
        assert_eq!(s.bytes, slotted * (12_304 + ENTRY_OVERHEAD));
        assert!(s.entries >= 348, "{} samples", s.entries);
        for i in 0..s.entries {
            assert_eq!(&tier.peek(&(1, i)).unwrap()[..], &vec![i as u8; len][..]);
        }
    }
}
