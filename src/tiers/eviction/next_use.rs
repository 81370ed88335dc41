//! Next use across every open stream, in bytes: the offline optimum's rule (Belady: let go of
//! what is needed furthest in the future), made online by what the daemon knows. Each open
//! stream reads one epoch's order (a pure function of its seed and epoch), from a position it
//! reports as it goes, at a speed measured in positions per lookup of the tier; the epoch after
//! it is known too. A sample's next use is the soonest time any stream reaches it: in its
//! current epoch if the stream has not passed it yet, else in its next.
//!
//! The entry let go is the one with the largest `(next use - now) * bytes / miss bytes`: the
//! memory an entry occupies until it is used again (bytes x time), per byte of raw storage a
//! hit on it saves reading. For samples of one size it is Belady's rule; with sizes that differ
//! it keeps, per byte of memory, the entries whose misses would cost most (Belady-size and
//! GreedyDual-Size weigh the same way; weighing by bytes alone would keep small samples and
//! lose byte hits). A newcomer comes in only if it would not itself be the one let go. Entries
//! no open stream will read (datasets nobody streams now) go first, least recently used first:
//! with no stream open this is a plain LRU.
//!
//! Bookkeeping: entries with a future sit in max-heaps by predicted time of next use, one per
//! weight class (the weight rounded to a quarter power of two, so that within a class the order
//! does not change with time), lazily: a changed entry gets a new item and its old one is
//! dropped when met. Predictions go stale as streams open, end or change speed; the heaps are
//! rebuilt from the streams' futures when a stream opens or ends (at most every `MIN_GAP`
//! lookups) and every half a tier's worth of lookups.

use super::{Eviction, Size};
use super::{Key, KeyMap};
use crate::tiers::orders::{Order, StreamEvent};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashSet};
use std::sync::Arc;

/// Fewest lookups between two rebuilds for streams opening or ending.
const MIN_GAP: u64 = 256;
/// Lookups over which a stream's speed is measured.
const RATE_WINDOW: u64 = 256;
/// Most finished streams kept waiting for their next epoch (the oldest go first).
const MAX_GHOSTS: usize = 64;

/// The streams on one order (a job's ranks and workers, jobs on one seed): the order is looked
/// up once per sample for all of them.
struct Group {
    order: Arc<Order>,
    next: Arc<Order>,
    cursors: Vec<Cursor>,
}

/// A stream's future, as the policy keeps it.
struct Cursor {
    /// The stream's id.
    id: u64,
    /// Every position of the group's order before this one is read, in the stream's share.
    position: u64,
    /// The clock when the stream reported `position`.
    at: u64,
    /// Positions per lookup of the tier (all streams' lookups).
    rate: f64,
    /// Lookups per position (1 / rate).
    per_position: f64,
    /// Whether `rate` is measured (else it is the other streams' mean, or 1).
    measured: bool,
    /// The position and clock the next measurement of the rate starts from.
    anchor: (u64, u64),
    /// A finished stream, kept for its next epoch until its successor opens or the clock
    /// passes this.
    expires: Option<u64>,
}

/// An entry's place in the policy.
struct Node {
    /// Which of the entry's heap items is current (unique over the policy's life: an item
    /// left from an earlier stay of the same sample never matches).
    gen: u64,
    /// Its weight class (`class_of`).
    class: i8,
    /// The clock of its next use as predicted; infinite: no open stream will read it.
    due: f64,
    /// Its last hit or insert (the order entries without a future go in).
    used: u64,
}

/// An entry in a heap, as of generation `gen`.
struct Item {
    due: f64,
    gen: u64,
    key: Key,
}

impl PartialEq for Item {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Item {}
impl PartialOrd for Item {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Item {
    fn cmp(&self, other: &Self) -> Ordering {
        self.due
            .total_cmp(&other.due)
            .then(self.key.cmp(&other.key))
            .then(self.gen.cmp(&other.gen))
    }
}

pub struct NextUse {
    /// The open streams (and finished ones waiting for their next epoch), by order.
    groups: Vec<Group>,
    entries: KeyMap<Node>,
    /// Entries with a future, furthest first, by weight class.
    heaps: BTreeMap<i8, BinaryHeap<Item>>,
    /// Heap items, current or not.
    items: usize,
    /// Entries without a future, least recently used first.
    idle: BTreeSet<(u64, Key)>,
    /// Streams opened or ended since the last rebuild.
    dirty: bool,
    /// The clock of the last rebuild.
    rebuilt: u64,
    /// The last generation given out.
    generation: u64,
    /// The last newcomer's predicted next use and the clock it was predicted at: its insert
    /// follows at once and need not look it up in every order again.
    newcomer: Option<(Key, u64, f64)>,
}

impl NextUse {
    pub fn new() -> NextUse {
        NextUse {
            groups: Vec::new(),
            entries: KeyMap::default(),
            heaps: BTreeMap::new(),
            items: 0,
            idle: BTreeSet::new(),
            dirty: false,
            rebuilt: 0,
            newcomer: None,
            generation: 0,
        }
    }

    /// Streams known, open or finished.
    fn streams(&self) -> usize {
        self.groups.iter().map(|g| g.cursors.len()).sum()
    }

    /// Stream `id`'s cursor, and the length of its order.
    fn cursor(&mut self, id: u64) -> Option<(u64, &mut Cursor)> {
        self.groups.iter_mut().find_map(|g| {
            let len = g.order.len();
            g.cursors.iter_mut().find(|c| c.id == id).map(|c| (len, c))
        })
    }

    /// Forgets stream `id` (and its order, if it was the last on it).
    fn forget(&mut self, id: u64) {
        for g in &mut self.groups {
            g.cursors.retain(|c| c.id != id);
        }
        self.groups.retain(|g| !g.cursors.is_empty());
    }

    /// Predicts `key`'s next use again, and puts it where that says (touched: it was used now).
    fn place(&mut self, key: Key, clock: u64, touched: bool) {
        let due = match self.newcomer.take() {
            Some((k, at, due)) if k == key && at == clock => due,
            _ => due_of(&self.groups, &key),
        };
        let Some(node) = self.entries.get_mut(&key) else {
            return;
        };
        if node.due.is_infinite() {
            self.idle.remove(&(node.used, key));
        }
        if touched {
            node.used = clock;
        }
        self.generation += 1;
        node.gen = self.generation;
        node.due = due;
        if due.is_infinite() {
            self.idle.insert((node.used, key));
        } else {
            let item = Item {
                due,
                gen: node.gen,
                key,
            };
            self.heaps.entry(node.class).or_default().push(item);
            self.items += 1;
        }
    }

    /// Drops finished streams whose successor never came (and the oldest beyond `MAX_GHOSTS`).
    fn expire(&mut self, clock: u64) {
        let before = self.streams();
        for g in &mut self.groups {
            g.cursors.retain(|c| c.expires.is_none_or(|e| e > clock));
        }
        let waiting = (self.groups.iter().flat_map(|g| &g.cursors))
            .filter(|c| c.expires.is_some())
            .count();
        if waiting > MAX_GHOSTS {
            let mut ghosts: Vec<(u64, u64)> = (self.groups.iter().flat_map(|g| &g.cursors))
                .filter_map(|c| c.expires.map(|e| (e, c.id)))
                .collect();
            ghosts.sort_unstable();
            for &(_, id) in &ghosts[..ghosts.len() - MAX_GHOSTS] {
                for g in &mut self.groups {
                    g.cursors.retain(|c| c.id != id);
                }
            }
        }
        self.groups.retain(|g| !g.cursors.is_empty());
        self.dirty |= self.streams() != before;
    }

    /// Drops expired finished streams, and rebuilds the heaps when streams changed or the
    /// predictions have aged.
    fn refresh(&mut self, clock: u64) {
        self.expire(clock);
        let since = clock.saturating_sub(self.rebuilt);
        let period = (self.entries.len() as u64 * 2).max(4096);
        let aged = since >= period && !self.groups.is_empty();
        if (self.dirty && since >= MIN_GAP) || aged {
            self.rebuild(clock);
        } else if self.items > 4 * self.entries.len() + 1024 {
            self.compact();
        }
    }

    /// Drops the heap items no longer current (an entry's earlier predictions, entries gone).
    fn compact(&mut self) {
        let entries = &self.entries;
        for heap in self.heaps.values_mut() {
            heap.retain(|i| entries.get(&i.key).is_some_and(|n| n.gen == i.gen));
        }
        self.heaps.retain(|_, h| !h.is_empty());
        self.items = self.heaps.values().map(BinaryHeap::len).sum();
    }

    /// Predicts every entry's next use again.
    fn rebuild(&mut self, clock: u64) {
        self.newcomer = None;
        let mut heaps: BTreeMap<i8, Vec<Item>> = BTreeMap::new();
        self.idle.clear();
        for (key, node) in self.entries.iter_mut() {
            self.generation += 1;
            node.gen = self.generation;
            node.due = due_of(&self.groups, key);
            if node.due.is_infinite() {
                self.idle.insert((node.used, *key));
            } else {
                heaps.entry(node.class).or_default().push(Item {
                    due: node.due,
                    gen: node.gen,
                    key: *key,
                });
            }
        }
        self.items = heaps.values().map(Vec::len).sum();
        self.heaps = heaps.into_iter().map(|(c, v)| (c, v.into())).collect();
        self.dirty = false;
        self.rebuilt = clock;
    }

    /// The entry to let go first, and its weighed distance to its next use (infinite: none).
    fn top(&mut self, clock: u64) -> Option<(Key, f64)> {
        if let Some(&(_, key)) = self.idle.first() {
            return Some((key, f64::INFINITY));
        }
        let now = clock as f64;
        let NextUse {
            heaps,
            entries,
            items,
            ..
        } = self;
        let mut best: Option<(Key, f64)> = None;
        for (&class, heap) in heaps.iter_mut() {
            while let Some(top) = heap.peek() {
                match entries.get(&top.key) {
                    Some(n) if n.gen == top.gen => break,
                    _ => {
                        heap.pop();
                        *items -= 1;
                    }
                }
            }
            if let Some(top) = heap.peek() {
                let weighed = (top.due - now) * weight(class);
                if best.is_none_or(|(_, b)| weighed > b) {
                    best = Some((top.key, weighed));
                }
            }
        }
        best
    }
}

impl Default for NextUse {
    fn default() -> Self {
        NextUse::new()
    }
}

/// When the streams of `groups` next read `key`, in lookups of the tier (infinite: never).
fn due_of(groups: &[Group], key: &Key) -> f64 {
    let mut due = f64::INFINITY;
    for g in groups {
        if g.order.key.dataset != key.0 {
            continue;
        }
        let Some(p) = g.order.position(key.1) else {
            continue;
        };
        // Where it comes in the next epoch, looked up once, if a stream has passed it.
        let mut next = None;
        for c in &g.cursors {
            let distance = if p >= c.position {
                p - c.position
            } else {
                match *next.get_or_insert_with(|| g.next.position(key.1)) {
                    Some(q) => g.order.len().saturating_sub(c.position) + q,
                    None => continue,
                }
            };
            due = due.min(c.at as f64 + distance as f64 * c.per_position);
        }
    }
    due
}

/// The weight class of an entry: log2(bytes held / bytes a miss reads), in quarters.
fn class_of(size: Size) -> i8 {
    let w = size.bytes.max(1) as f64 / size.miss_bytes.max(1) as f64;
    (4.0 * w.log2()).round().clamp(-127.0, 127.0) as i8
}

fn weight(class: i8) -> f64 {
    (class as f64 / 4.0).exp2()
}

impl Eviction for NextUse {
    fn name(&self) -> &'static str {
        "next_use"
    }

    fn on_hit(&mut self, key: &Key, clock: u64) {
        self.place(*key, clock, true);
    }

    fn on_insert(&mut self, key: Key, size: Size, clock: u64) {
        let node = Node {
            gen: 0,
            class: class_of(size),
            due: 0.0,
            used: clock,
        };
        if self.entries.insert(key, node).is_none() {
            self.place(key, clock, true);
        }
    }

    fn victim_for_newcomer(&mut self, newcomer: &Key, size: Size, clock: u64) -> Option<Key> {
        self.refresh(clock);
        let (victim, weighed) = self.top(clock)?;
        if weighed.is_infinite() {
            return Some(victim);
        }
        let due = match self.newcomer {
            Some((k, at, due)) if k == *newcomer && at == clock => due,
            _ => due_of(&self.groups, newcomer),
        };
        self.newcomer = Some((*newcomer, clock, due));
        let newcomer = (due - clock as f64) * weight(class_of(size));
        (newcomer < weighed).then_some(victim)
    }

    fn victim(&mut self, clock: u64) -> Option<Key> {
        self.refresh(clock);
        self.top(clock).map(|(k, _)| k)
    }

    fn on_remove(&mut self, key: &Key) {
        if let Some(node) = self.entries.remove(key) {
            if node.due.is_infinite() {
                self.idle.remove(&(node.used, *key));
            }
        }
    }

    fn on_stream(&mut self, event: StreamEvent, clock: u64) {
        self.newcomer = None;
        self.expire(clock);
        match event {
            StreamEvent::Opened {
                id,
                order,
                next,
                position,
            } => {
                // The successor of a finished stream takes its place.
                let ghost = self
                    .groups
                    .iter()
                    .filter(|g| g.next.key == order.key)
                    .flat_map(|g| &g.cursors)
                    .find(|c| c.expires.is_some())
                    .map(|c| c.id);
                if let Some(ghost) = ghost {
                    self.forget(ghost);
                }
                let measured: Vec<f64> = (self.groups.iter().flat_map(|g| &g.cursors))
                    .filter(|c| c.measured)
                    .map(|c| c.rate)
                    .collect();
                let rate = match measured.len() {
                    0 => 1.0,
                    n => measured.iter().sum::<f64>() / n as f64,
                };
                let position = position.min(order.len());
                let cursor = Cursor {
                    id,
                    position,
                    at: clock,
                    rate,
                    per_position: 1.0 / rate,
                    measured: false,
                    anchor: (position, clock),
                    expires: None,
                };
                match self.groups.iter_mut().find(|g| g.order.key == order.key) {
                    Some(g) => g.cursors.push(cursor),
                    None => self.groups.push(Group {
                        order,
                        next,
                        cursors: vec![cursor],
                    }),
                }
                self.dirty = true;
            }
            StreamEvent::At { id, position } => {
                let Some((len, c)) = self.cursor(id) else {
                    return;
                };
                let position = position.min(len);
                if position > c.position {
                    c.position = position;
                    c.at = clock;
                }
                let (from, since) = c.anchor;
                if clock >= since + RATE_WINDOW && c.position > from {
                    let rate = (c.position - from) as f64 / (clock - since) as f64;
                    c.rate = if c.measured {
                        0.5 * c.rate + 0.5 * rate
                    } else {
                        rate
                    };
                    c.per_position = 1.0 / c.rate;
                    c.measured = true;
                    c.anchor = (c.position, clock);
                }
            }
            StreamEvent::Closed { id, finished } => {
                if finished {
                    if let Some((len, c)) = self.cursor(id) {
                        c.position = len;
                        c.at = clock;
                        c.expires = Some(clock + (len / 4).max(1024));
                    }
                } else {
                    self.forget(id);
                }
                self.dirty = true;
            }
        }
    }

    fn extra_bytes(&self) -> usize {
        let mut orders = HashSet::new();
        let mut bytes = self.streams() * std::mem::size_of::<Cursor>()
            + self.groups.len() * std::mem::size_of::<Group>();
        for g in &self.groups {
            for o in [&g.order, &g.next] {
                if orders.insert(Arc::as_ptr(o)) {
                    bytes += o.bytes();
                }
            }
        }
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::MAX_GHOSTS;
    use crate::sampler::epoch_order;
    use crate::tiers::eviction::PolicyName;
    use crate::tiers::memory::{cost_of, MemoryTier};
    use crate::tiers::orders::OrderKey;
    use bytes::Bytes;

    /// A job: its seed, the epochs it reads, the lookup (of all jobs') it starts at, and an
    /// epoch it gives up half way through (its client went away).
    #[derive(Clone, Copy)]
    struct Job {
        seed: u64,
        epochs: u64,
        start: usize,
        cancel: Option<u64>,
    }

    const N: u64 = 400;
    static SAMPLE: [u8; 4096] = [1; 4096];
    const BATCH: u64 = 10;

    /// Runs `jobs` over one dataset of N samples through a tier of `slots` entries of
    /// `policy`, batch by batch in turn, telling the tier where each stream is as the daemon
    /// does. Returns the lookups in order and which were hits.
    fn run(policy: PolicyName, jobs: &[Job], slots: u64) -> (Vec<u64>, Vec<bool>) {
        // Samples of 4 kB: the orders the policy keeps (1.6 kB each, taken off the budget too)
        // cost the tier at most an entry or two.
        let tier = MemoryTier::named(slots * cost_of(SAMPLE.len()), policy);
        struct State {
            job: Job,
            epoch: u64,
            order: Vec<u64>,
            at: u64,
            id: u64,
        }
        let mut states: Vec<Option<State>> = jobs.iter().map(|_| None).collect();
        let (mut trace, mut hits) = (vec![], vec![]);
        let mut next_id = 1;
        let mut done = vec![false; jobs.len()];
        let mut step = 0usize;
        while done.iter().any(|d| !d) {
            for (j, job) in jobs.iter().enumerate() {
                if done[j] || step < job.start {
                    continue;
                }
                let state = states[j].get_or_insert_with(|| State {
                    job: *job,
                    epoch: u64::MAX,
                    order: vec![],
                    at: N,
                    id: 0,
                });
                if state.at >= N {
                    // Open the next epoch (the one before closed as finished).
                    if state.epoch != u64::MAX {
                        tier.stream_closed(state.id, true);
                    }
                    state.epoch = state.epoch.wrapping_add(1);
                    if state.epoch >= state.job.epochs {
                        done[j] = true;
                        continue;
                    }
                    state.order = epoch_order(N, state.job.seed, state.epoch, true);
                    state.at = 0;
                    state.id = next_id;
                    next_id += 1;
                    let key = OrderKey {
                        dataset: 0,
                        num_samples: N,
                        seed: state.job.seed,
                        epoch: state.epoch,
                        shuffle: true,
                        split: None,
                        form: crate::sampler::OrderForm::V1,
                        correlated: None,
                    };
                    tier.stream_opened(state.id, key, 0);
                }
                if state.job.cancel == Some(state.epoch) && state.at >= N / 2 {
                    tier.stream_closed(state.id, false);
                    done[j] = true;
                    continue;
                }
                tier.stream_at(state.id, state.at + BATCH);
                for p in state.at..state.at + BATCH {
                    let s = state.order[p as usize];
                    let hit = tier.get(&(0, s)).is_some();
                    if !hit {
                        tier.insert((0, s), Bytes::from_static(&SAMPLE), 1);
                    }
                    trace.push(s);
                    hits.push(hit);
                }
                state.at += BATCH;
            }
            step += 1;
        }
        (trace, hits)
    }

    /// Belady's MIN with bypass, by brute force: on a miss with the tier full, the held entry
    /// (or the newcomer) used furthest in the future goes.
    fn belady(trace: &[u64], slots: usize) -> usize {
        let next_use = |from: usize, s: u64| {
            trace[from..]
                .iter()
                .position(|&t| t == s)
                .unwrap_or(usize::MAX)
        };
        let (mut held, mut hits) = (Vec::<u64>::new(), 0);
        for (i, &s) in trace.iter().enumerate() {
            if held.contains(&s) {
                hits += 1;
                continue;
            }
            if held.len() < slots {
                held.push(s);
                continue;
            }
            let (far, at) = held
                .iter()
                .enumerate()
                .map(|(k, &h)| (next_use(i + 1, h), k))
                .max()
                .unwrap();
            if next_use(i + 1, s) < far {
                held[at] = s;
            }
        }
        hits
    }

    fn rate(hits: &[bool]) -> f64 {
        hits.iter().filter(|&&h| h).count() as f64 / hits.len() as f64
    }

    fn check(jobs: &[Job], slots: u64) {
        let (trace, hits) = run(PolicyName::NextUse, jobs, slots);
        let best = belady(&trace, slots as usize) as f64 / trace.len() as f64;
        let ours = rate(&hits);
        let (_, lru) = run(PolicyName::StaleLru, jobs, slots);
        assert!(
            ours >= best - 0.05,
            "{slots} slots: next use {ours:.3}, Belady {best:.3} (stale LRU {:.3})",
            rate(&lru)
        );
    }

    fn distinct(k: u64) -> Vec<Job> {
        (0..k)
            .map(|j| Job {
                seed: 100 + j,
                epochs: 3,
                start: 0,
                cancel: None,
            })
            .collect()
    }

    #[test]
    fn within_five_points_of_belady_for_jobs_of_distinct_seeds() {
        for (k, slots) in [(1, N / 2), (2, N / 2), (2, N / 4), (4, N / 4)] {
            check(&distinct(k), slots);
        }
    }

    #[test]
    fn within_five_points_of_belady_for_jobs_on_one_seed() {
        let one = |k: u64| -> Vec<Job> {
            (0..k as usize)
                .map(|j| Job {
                    seed: 42,
                    epochs: 3,
                    start: j * 2,
                    cancel: None,
                })
                .collect()
        };
        check(&one(3), N * 35 / 100);
        check(&one(4), N / 4);
    }

    #[test]
    fn within_five_points_of_belady_as_jobs_join_and_leave() {
        let jobs = [
            Job {
                seed: 1,
                epochs: 4,
                start: 0,
                cancel: None,
            },
            Job {
                seed: 2,
                epochs: 3,
                start: 30,
                cancel: Some(1),
            },
            Job {
                seed: 3,
                epochs: 2,
                start: 50,
                cancel: None,
            },
        ];
        check(&jobs, N / 3);
    }

    #[test]
    fn a_cancelled_streams_future_is_dropped_and_its_memory_with_it() {
        let tier = MemoryTier::new(1 << 20);
        let empty = tier.snapshot().policy_bytes;
        let key = |seed| OrderKey {
            dataset: 0,
            num_samples: 10_000,
            seed,
            epoch: 0,
            shuffle: true,
            split: None,
            form: crate::sampler::OrderForm::V1,
            correlated: None,
        };
        tier.stream_opened(1, key(1), 0);
        tier.stream_opened(2, key(1), 0);
        let one = tier.snapshot().policy_bytes;
        assert!(one >= empty + 2 * 40_000, "two orders of 10,000: {one}");
        tier.stream_opened(3, key(2), 0);
        assert!(
            tier.snapshot().policy_bytes >= one + 40_000,
            "a second seed"
        );
        for id in [1, 2, 3] {
            tier.stream_at(id, 500);
            tier.stream_closed(id, false);
        }
        assert_eq!(tier.snapshot().policy_bytes, empty);
        // The orders themselves are freed, not only forgotten.
        assert_eq!(tier.orders.live(), 0);
    }

    #[test]
    fn futures_count_in_the_budget_and_finished_streams_waiting_are_capped() {
        let budget = 1 << 24;
        let tier = MemoryTier::new(budget);
        let key = |seed| OrderKey {
            dataset: 0,
            num_samples: 10_000,
            seed,
            epoch: 0,
            shuffle: true,
            split: None,
            form: crate::sampler::OrderForm::V1,
            correlated: None,
        };
        // Streams that read their whole epoch and end: each leaves its next epoch known.
        for seed in 0..200 {
            tier.stream_opened(seed, key(seed), 0);
            tier.stream_at(seed, 10_000);
            tier.stream_closed(seed, true);
        }
        let s = tier.snapshot();
        let per_stream = 2 * 40_000;
        assert!(s.policy_bytes >= MAX_GHOSTS as u64 * per_stream);
        assert!(s.policy_bytes <= (MAX_GHOSTS as u64 + 1) * (per_stream + 1024));
        assert_eq!(
            s.limit,
            budget - s.policy_bytes,
            "taken off the tier's budget"
        );
        tier.set_reserved(1 << 20);
        assert_eq!(tier.snapshot().limit, budget - s.policy_bytes - (1 << 20));
    }

    #[test]
    fn a_sample_evicted_and_taken_in_again_is_placed_by_its_new_prediction() {
        let tier = MemoryTier::new(2 * cost_of(SAMPLE.len()) + 1024);
        let one = || Bytes::from_static(&SAMPLE);
        let key = OrderKey {
            dataset: 0,
            num_samples: 100,
            seed: 5,
            epoch: 0,
            shuffle: false,
            split: None,
            form: crate::sampler::OrderForm::V1,
            correlated: None,
        };
        tier.stream_opened(1, key, 0);
        // 90 is held, used and let go, then taken in again while 10 and 20 are held.
        assert!(tier.insert((0, 90), one(), 1));
        assert!(tier.get(&(0, 90)).is_some());
        assert!(tier.insert((0, 10), one(), 1));
        assert!(tier.insert((0, 20), one(), 1), "90 is read last: it goes");
        assert!(tier.peek(&(0, 90)).is_none());
        tier.stream_at(1, 15);
        assert!(tier.get(&(0, 10)).is_some());
        // Now 10 was read (next epoch) and 90 comes before it: 90 in, 10 out.
        assert!(tier.insert((0, 90), one(), 1));
        assert!(tier.peek(&(0, 10)).is_none());
        // 30 comes before 90 and 20 is sooner still: 90 goes, not by an old prediction.
        assert!(tier.insert((0, 30), one(), 1));
        assert!(tier.peek(&(0, 90)).is_none());
        assert!(tier.peek(&(0, 20)).is_some());
    }

    #[test]
    fn entries_no_stream_reads_go_first_and_a_newcomer_without_a_future_stays_out() {
        // Room for three entries, and the stream's order (taken off the budget too).
        let tier = MemoryTier::new(3 * cost_of(SAMPLE.len()) + 1024);
        let one = || Bytes::from_static(&SAMPLE);
        // Dataset 9 is nobody's: its entry goes before any of dataset 0's.
        assert!(tier.insert((9, 0), one(), 1));
        let key = OrderKey {
            dataset: 0,
            num_samples: 100,
            seed: 5,
            epoch: 0,
            shuffle: false,
            split: None,
            form: crate::sampler::OrderForm::V1,
            correlated: None,
        };
        tier.stream_opened(1, key, 0);
        assert!(tier.insert((0, 10), one(), 1));
        assert!(tier.insert((0, 20), one(), 1));
        assert!(tier.insert((0, 30), one(), 1));
        assert!(tier.peek(&(9, 0)).is_none(), "nobody's entry went first");
        // Sample 90 is read after 10, 20, 30: it stays out; 5 comes first: 30 makes room.
        assert!(!tier.insert((0, 90), one(), 1));
        assert!(tier.insert((0, 5), one(), 1));
        assert!(tier.peek(&(0, 30)).is_none());
        // Nobody's newcomer stays out while every entry has a future.
        assert!(!tier.insert((9, 1), one(), 1));
    }

    #[test]
    fn weighs_the_bytes_held_against_the_bytes_a_miss_reads() {
        // Two entries due at the same time: the one holding more memory per byte its miss
        // reads goes.
        let tier = MemoryTier::new(2 * cost_of(1000) + 1024);
        let key = OrderKey {
            dataset: 0,
            num_samples: 100,
            seed: 5,
            epoch: 0,
            shuffle: false,
            split: None,
            form: crate::sampler::OrderForm::V1,
            correlated: None,
        };
        tier.stream_opened(1, key, 0);
        assert!(tier.insert((0, 50), Bytes::from(vec![0u8; 1000]), 1000));
        assert!(tier.insert((0, 51), Bytes::from(vec![0u8; 1000]), 10));
        assert!(tier.insert((0, 40), Bytes::from(vec![0u8; 1000]), 1000));
        assert!(tier.peek(&(0, 51)).is_none(), "cheap to read again, goes");
        assert!(tier.peek(&(0, 50)).is_some());
    }
}
